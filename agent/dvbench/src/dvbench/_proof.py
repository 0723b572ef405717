"""``experiment.proof()``: the backend's ZKDV driver with DVBench upload behaviour mixed in.

The returned object's class is created once per backend driver class as
``type(name, (DVBenchProof, zkdv.jax.ZKDV), {})``: it *is* a ``zkdv.jax.ZKDV`` (every
method, ``isinstance`` check and TrainState identity check behaves as documented), and
:class:`DVBenchProof` only adds :meth:`~DVBenchProof.finish`, a background uploader
started by ``start()``, :meth:`~DVBenchProof.save_model` for the final weights, and the
binding of the transcript to the experiment.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dvbench._config import cache_dir
from dvbench._contracts import Bound
from dvbench._exceptions import (
    APIError,
    CertificateFailedError,
    DVBenchError,
    NetworkError,
    UploadError,
)
from dvbench._manifest import TRANSCRIPT, Manifest, sha256_file
from dvbench._progress import Progress, ProgressCallback
from dvbench._result import SyncResult
from dvbench._sync import Uploader, release, settle

if TYPE_CHECKING:
    from dvbench._model import SavedModel
    from zkdv.config import ZKDVConfig

__all__ = ["DVBenchProof", "create_proof", "runs_dir"]

log = logging.getLogger("dvbench")


def runs_dir() -> Path:
    """Where temporary proof directories live: ``<cache>/runs``."""
    return cache_dir() / "runs"


def _new_run_dir(name: str) -> Path:
    owner, _, short = name.partition("/")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return runs_dir() / owner / short / f"{stamp}-{secrets.token_hex(3)}"


class _Background:
    """Uploads new snapshot and batch files every few seconds while training runs.

    Runs on its own daemon thread, so a slow or failing network never stalls a training
    step: a failure is logged and retried with a growing pause, and whatever is left is
    sent by ``finish()``.
    """

    def __init__(self, uploader: Uploader, interval: float) -> None:
        self.uploader = uploader
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dvbench-uploader", daemon=True)
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        pause = self.interval
        while not self._stop.wait(pause):
            try:
                self.uploader.run(final=False)
                pause = self.interval
            except Exception as error:  # noqa: BLE001 - never let the uploader kill training
                if not self._warned:
                    log.warning(
                        "dvbench: background upload failed (%s); training continues and "
                        "finish() sends what is left",
                        error,
                    )
                    self._warned = True
                pause = min(pause * 2, 120.0)

    def stop(self) -> None:
        """Ask the thread to stop and wait for the file it is sending to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class _State:
    def __init__(
        self,
        experiment: Bound,
        manifest: Manifest,
        progress: bool | None,
    ) -> None:
        self.experiment = experiment
        self.client = experiment.client
        self.manifest = manifest
        self.progress = progress
        self.lock = threading.Lock()
        self.uploader = None if self.client.offline else Uploader(self.client, manifest)
        self.background: _Background | None = None
        self.closed = False
        self.result: SyncResult | None = None

    def start_background(self) -> None:
        if self.uploader is not None and self.background is None:
            self.background = _Background(self.uploader, self.client.settings.scan_interval)
            self.background.start()

    def stop_background(self) -> None:
        if self.background is not None:
            self.background.stop()

    # --- the steps of DVBenchProof.finish() -----------------------------------------------
    def settle_again(self, *, wait: bool, timeout: float) -> None:
        """A finished proof asked again: with ``wait``, wait for its verdict this time."""
        result = self.result
        assert result is not None
        if wait and self.uploader is not None and result.proof_id is not None:
            settle(self.client, self.uploader, result, wait=True, timeout=timeout)
            print(result.verdict.summary() if result.verdict else "", file=sys.stderr)

    def nothing_to_upload(self, *, follower: bool) -> SyncResult:
        """The result of a run that wrote no transcript (a follower rank, or no step)."""
        directory = self.manifest.directory
        result = SyncResult(directory, self.experiment.name)
        if follower:
            result.notes.append("a follower rank: rank 0 uploads the transcript")
        else:
            result.notes.append("no training step ran: there is no transcript to upload")
            log.warning("dvbench: %s: no training step ran; nothing uploaded", directory)
        if self.manifest.data.get("ephemeral"):
            release(directory)
            result.released = True
        return result

    def upload(self, on_progress: ProgressCallback | None) -> SyncResult:
        """Send what is left of the proof, the transcript last, with a progress bar."""
        assert self.uploader is not None
        directory = self.manifest.directory
        bar = Progress(enabled=self.progress, callback=on_progress)
        self.uploader.progress = bar
        try:
            result = self.uploader.run(final=True)
        except (APIError, NetworkError, UploadError) as error:
            bar.close()
            error.add_note(
                f"The proof is kept in {directory}; call finish() again, or run "
                f"`dvbench sync {directory}`, to resume the upload."
            )
            raise
        bar.close()
        return result

    def conclude(self, result: SyncResult, *, wait: bool, timeout: float) -> None:
        """Ask for (or, with ``wait``, wait for) the verdict, say it, release the directory."""
        assert self.uploader is not None
        if wait:
            # The upload's summary first: waiting for replays can take a while.
            print(result.summary(), file=sys.stderr)
        settle(self.client, self.uploader, result, wait=wait, timeout=timeout)
        if result.complete and self.manifest.data.get("ephemeral"):
            release(self.manifest.directory)
            result.released = True
        self.result = result
        if wait:
            print(result.verdict.summary() if result.verdict else "", file=sys.stderr)
        else:
            print(result.summary(), file=sys.stderr)


class DVBenchProof:
    """DVBench behaviour added to a ZKDV driver; see :meth:`Experiment.proof`.

    Attributes:
        experiment: the :class:`~dvbench.Experiment` the transcript is bound to.
        directory: the proof directory (``records.cborl``, ``files/``, the manifest).
    """

    _dvbench: _State
    # Provided by the driver class this is mixed into (zkdv.driver.Driver).
    path: Path
    digest: bytes | None

    if TYPE_CHECKING:

        def close(self) -> None: ...
        def bind_experiment(self, name: str, spec_digest: str) -> None: ...
        @property
        def steps(self) -> int: ...

    def _dvbench_init(self, experiment: Bound, manifest: Manifest, progress: bool | None) -> None:
        self._dvbench = _State(experiment, manifest, progress)
        assert experiment.spec_digest is not None
        self.bind_experiment(experiment.name, experiment.spec_digest)

    @property
    def experiment(self) -> Bound:
        return self._dvbench.experiment

    @property
    def directory(self) -> Path:
        return self._dvbench.manifest.directory

    def start(self, *args: Any, **kwargs: Any) -> None:
        """The driver's ``start()``; then snapshot and batch files upload in the background."""
        super().start(*args, **kwargs)  # type: ignore[misc]
        if not self._dvbench_follower:
            self._dvbench.start_background()

    @property
    def _dvbench_follower(self) -> bool:
        # A torch.distributed rank other than 0 trains but writes no transcript: rank 0
        # owns the tape and uploads it.
        return bool(getattr(self, "follower", False))

    def _close_transcript(self) -> None:
        """Close the driver once (waiting for every commitment) and mark the manifest."""
        state = self._dvbench
        if state.closed:
            return
        try:
            self.close()
        finally:
            # Stopped before the manifest changes hands: from here on only this thread
            # writes it.
            state.stop_background()
        state.closed = True
        state.manifest.update(
            finished=True,
            steps=self.steps,
            digest=self.digest.hex() if self.digest else None,
        )

    def save_model(
        self, params: Any, directory: str | os.PathLike[str] | None = None
    ) -> SavedModel | None:
        """Save the final parameters as safetensors, signed in the OpenSSF format; before finish().

        Closes the transcript (as ``finish()`` would: it waits for every commitment),
        then writes ``model/model.safetensors`` into the proof directory with the
        tensors named and ordered as the transcript's parameter schema, checks that they
        commit to the close record's final parameter root, and signs the file with
        ``model_signing`` (``model/model.sig``, ``model/model-signing.pub``; see
        :mod:`dvbench._model`). ``finish()`` then uploads the three with the proof, and
        the certificate binds the file's SHA-256 and the signed manifest's digest.

        Args:
            params: the final parameters: a JAX PyTree (``state.params``) or a
                ``torch.nn.Module`` (its ``named_parameters()``), as trained.
            directory: also copy the three files there (what you publish).

        Returns:
            What was written; None on a follower rank of a multi-process run (rank 0
            saves the model).

        Raises:
            ModelMismatchError: ``params`` are not the parameters the transcript's final
                state commits (another tree, or values changed after the last step).
            ImportError: ``model_signing`` is not installed (``dvbench[signing]``).
        """
        from dvbench._model import SavedModel, copy_model, sign_model
        from dvbench.attest import model_signature_subject

        if self._dvbench_follower:
            return None
        with self._dvbench.lock:
            self._close_transcript()
        path = _write_final_model(
            self.directory,
            params,
            backend=str(self._dvbench.manifest.data.get("backend")),
            experiment=self.experiment.name,
            digest=self.digest,
        )
        signature, public_key = sign_model(path)
        _, manifest = model_signature_subject(signature.read_bytes())
        saved = SavedModel(path, signature, public_key, sha256_file(path), manifest)
        if directory is not None:
            saved = SavedModel(
                path, signature, public_key, saved.sha256, manifest, copy_model(saved, directory)
            )
        return saved

    def finish(
        self,
        *,
        wait: bool = False,
        timeout: float = 1800.0,
        on_progress: ProgressCallback | None = None,
    ) -> SyncResult:
        """Close the driver, upload the proof, report its verdict, release temporary storage.

        Waits for every commitment and sampled check (``close()``), then for the
        background uploader, then sends what is left: the program artifact, probes,
        snapshot and batch files, and the transcript last, which files the proof. A
        temporary proof directory is removed once everything is on the platform.

        Then it says the verdict, on stderr and as ``result.verdict``: certificate PASSED,
        FAILED with the failed claims (each declared limit the run broke), pending (the
        platform is still verifying, or waits for replays), or a verifier error. Without
        ``wait`` it asks once and returns: an upload that succeeded is not a PASSED run,
        so a script that must fail on a FAILED certificate passes ``wait=True`` (or runs
        ``dvbench proofs show ID --wait``).

        Safe to call more than once: a finished proof returns the same result, and a
        call after a failed upload resumes it where it stopped. In offline mode nothing
        is sent; the directory is kept and the command that uploads it is printed.

        Args:
            wait: wait for the certificate (answering the platform's challenges as they
                are drawn) and raise :class:`CertificateFailedError` unless it records
                PASSED.
            timeout: with ``wait``, seconds to wait for the certificate.
            on_progress: called as ``on_progress(done, total)`` in bytes as the upload
                goes (every part, every deduplicated file), from the uploading threads;
                the same figures as the progress bar, whether or not it is drawn.

        Returns:
            What was uploaded, deduplicated and resumed, the proof's id, and its verdict.

        Raises:
            ZKDVPoisonedError: a sampled check failed (from ``close()``).
            APIError, NetworkError: the upload failed after retries; the proof stays on
                disk, and ``finish()`` or ``dvbench sync DIR`` resumes it.
            CertificateFailedError: with ``wait``: the certificate records FAILED (its
                ``verdict.failed`` lists the failed claims), the verifier failed, or no
                certificate came within ``timeout``.
        """
        state = self._dvbench
        with state.lock:
            if state.result is not None and (state.result.complete or state.result.offline):
                state.settle_again(wait=wait, timeout=timeout)
                return self._verdict_checked(state.result, wait)
            self._close_transcript()
            state.stop_background()
            if not (self.directory / TRANSCRIPT).exists():
                state.result = state.nothing_to_upload(follower=self._dvbench_follower)
                return state.result
            if state.uploader is None:
                state.result = SyncResult(self.directory, self.experiment.name, offline=True)
                print(state.result.summary(), file=sys.stderr)
                return state.result
            result = state.upload(on_progress)
            state.conclude(result, wait=wait, timeout=timeout)
            return self._verdict_checked(result, wait)

    @staticmethod
    def _verdict_checked(result: SyncResult, wait: bool) -> SyncResult:
        """``result``, or (``wait``) CertificateFailedError unless its verdict is PASSED."""
        verdict = result.verdict
        if wait and result.proof_id is not None and (verdict is None or not verdict.passed):
            if verdict is None:
                raise DVBenchError(f"no verdict for proof {result.proof_id}: {result.notes}")
            message = verdict.summary()
            if not verdict.final:
                message = f"no certificate yet: {message}"
            raise CertificateFailedError(message, verdict=verdict)
        return result

    def __enter__(self) -> DVBenchProof:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """``with experiment.proof(...) as proof:`` finishes on success; on an exception
        it only closes the driver and keeps the proof directory."""
        if exc_type is None:
            self.finish()
            return
        self._dvbench.stop_background()
        try:
            self.close()
        except Exception:
            log.warning("dvbench: closing the proof after an error failed too", exc_info=True)


def _write_final_model(
    directory: Path, params: Any, *, backend: str, experiment: str, digest: bytes | None
) -> Path:
    """Write ``params`` as the proof's ``model/model.safetensors`` and check it is the final state.

    The tensors are named and ordered as the transcript's parameter schema; the file must
    commit to the close record's final parameter root, or it is removed.

    Raises:
        ModelMismatchError: ``params`` are not the parameters the final state commits.
    """
    from dvbench._model import (
        MODEL_DIR,
        MODEL_FILE,
        ModelMismatchError,
        check_final_parameters,
        write_safetensors,
    )
    from zkdv.config import ZKDVConfig

    root, close = _root_and_close(directory / TRANSCRIPT)
    specs = list((root.get("schema") or {}).get("params") or [])
    arrays = _parameter_arrays(params, backend)
    if len(arrays) != len(specs):
        raise ModelMismatchError(
            f"params has {len(arrays)} leaves; the transcript's parameter schema has "
            f"{len(specs)} ({', '.join(str(s.get('path')) for s in specs[:4])}, ...)"
        )
    value = (close.get("final") or {}).get("p")
    final = value.hex() if isinstance(value, bytes) else str(value or "")
    path = directory / MODEL_DIR / MODEL_FILE
    write_safetensors(
        path,
        [(str(spec["path"]), array) for spec, array in zip(specs, arrays, strict=True)],
        metadata={
            "zkdv.experiment": experiment,
            "zkdv.transcript_digest": digest.hex() if digest else "",
            "zkdv.final_parameter_root": final,
        },
    )
    chunk = ZKDVConfig.from_dict(root["config"]).chunk_bytes
    try:
        with open(path, "rb") as handle:
            check_final_parameters(
                handle, path.stat().st_size, specs=specs, chunk_bytes=chunk, final_root=final
            )
    except ModelMismatchError:
        path.unlink(missing_ok=True)
        raise
    return path


def _root_and_close(records: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The transcript's root and close records."""
    from zkdv.records import iter_records

    root: dict[str, Any] = {}
    close: dict[str, Any] = {}
    for record in iter_records(records):
        data = record.data
        if data.get("t") == "root":
            root = data
        elif data.get("t") == "close":
            close = data
    if not root or not close:
        raise DVBenchError(f"{records} has no root or close record; the run did not finish")
    return root, close


def _parameter_arrays(params: Any, backend: str) -> list[Any]:
    """Host arrays of the parameters, in the order the frontend commits them."""
    import numpy as np

    if backend == "torch" or hasattr(params, "named_parameters"):
        from zkdv.torch import host_array

        if not hasattr(params, "named_parameters"):
            raise TypeError("with backend='torch', save_model takes the torch.nn.Module trained")
        # zkdv.torch commits named_parameters() order, tied parameters once (as it lists them).
        return [host_array(parameter) for _, parameter in params.named_parameters()]
    import jax

    return [np.asarray(jax.device_get(leaf)) for leaf in jax.tree.leaves(params)]


_CLASSES: dict[type[Any], type[Any]] = {}
_CLASSES_LOCK = threading.Lock()


def proof_class(base: type[Any]) -> type[Any]:
    """``DVBenchProof`` mixed into the backend driver class ``base`` (created once)."""
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = type(
                base.__name__,
                (DVBenchProof, base),
                {
                    "__module__": __name__,
                    "__qualname__": f"DVBenchProof[{base.__module__}.{base.__qualname__}]",
                    "__doc__": f"{base.__module__}.{base.__qualname__} with DVBench uploads "
                    "(see dvbench.DVBenchProof).",
                },
            )
            _CLASSES[base] = cls
        return cls


def backend_class(backend: str) -> type[Any]:
    """``zkdv.jax.ZKDV`` or ``zkdv.torch.ZKDV``, with install advice if it cannot load."""
    try:
        module = importlib.import_module(f"zkdv.{backend}")
    except ImportError as error:
        raise ImportError(
            f"backend={backend!r} needs ZKDV's {backend} frontend and its framework: "
            f'pip install "dvbench[{backend}]" ({error})'
        ) from error
    driver = getattr(module, "ZKDV", None)
    if not isinstance(driver, type):
        raise ImportError(f"zkdv.{backend} has no ZKDV driver in this version of zkdv")
    return driver


def create_proof(
    experiment: Bound,
    backend: str,
    config: ZKDVConfig | None,
    *,
    path: str | os.PathLike[str] | None,
    progress: bool | None,
    options: dict[str, Any],
) -> DVBenchProof:
    base = backend_class(backend)
    if path is None:
        directory, ephemeral = _new_run_dir(experiment.name), not experiment.client.offline
    else:
        directory, ephemeral = Path(path), False
    if (directory / TRANSCRIPT).exists():
        raise DVBenchError(
            f"{directory} already holds a transcript; give each run its own proof directory"
        )
    directory.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.create(
        directory,
        experiment=experiment.name,
        spec_digest=str(experiment.spec_digest),
        backend=backend,
        base_url=experiment.client.base_url,
        ephemeral=ephemeral,
        spec=experiment.pending_spec,
    )
    proof: DVBenchProof = proof_class(base)(directory, config, **options)
    proof._dvbench_init(experiment, manifest, progress)
    return proof
