"""Resumable, content-addressed upload of a proof directory.

A proof directory holds what ZKDV wrote (``records.cborl``, ``probes.bin``, the program
artifact, ``files/`` with snapshot and batch files) and ``dvbench-sync.json``, the
manifest of what has reached the platform. The manifest is rewritten atomically after
every step of an upload (upload created, part sent, upload completed), so a dropped
connection or a killed process loses at most one part:

1. each file is hashed (SHA-256) and its kind named (transcript, artifact, snapshot,
   batch);
2. a file the platform already holds for this experiment (same digest and kind) is
   *deduplicated*: recorded, never sent;
3. otherwise an upload is opened with the file's size and digest, and its parts are
   sent with ``X-Part-SHA256``; an interrupted upload asks the platform which parts it
   has and sends only the missing or different ones;
4. the transcript goes last, so the program and files are there when its proof is
   filed; then the proof's artifact list is attached
   (``POST /api/v1/proofs/<id>/artifacts/``).

Which snapshot and batch files leave the lab is ``DVBENCH_UPLOAD_FILES``: with
``challenged`` (the default) none is sent while training; once the transcript is filed
the uploader waits for the platform to verify it and draw its challenges
(``GET /api/v1/proofs/<id>/challenges/?status=pending``), then sends only the files
those challenges name, and attaches them. The platform's replays need nothing else, so
the rest of the weights and data never leave. With ``all`` every file is sent, in the
background while training, as before.

``dvbench sync DIR`` runs the same steps on a directory left by offline mode or by an
interrupted process.

The manifest and the file kinds are ``dvbench._manifest``; the steps of one file (2 and
3) are ``dvbench._transfer``; this module holds the directory's: the order, the
experiment, the challenges and the artifact list.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvbench._contracts import Api
from dvbench._exceptions import (
    APIError,
    ConflictError,
    DVBenchError,
    NotFoundError,
    UploadError,
)
from dvbench._manifest import (
    LOCK,
    MANIFEST,
    TRANSCRIPT,
    Manifest,
    adopt_directory,
    kind_of,
    utc_timestamp,
)
from dvbench._progress import Progress, ProgressCallback
from dvbench._result import SyncResult
from dvbench._transfer import FileUploader

if TYPE_CHECKING:
    from dvbench._verdict import Verdict

__all__ = ["Uploader", "release", "settle", "sync_directory"]

log = logging.getLogger("dvbench")


def _flock(handle: Any, exclusive: bool) -> None:
    if sys.platform == "win32":  # pragma: no cover - the in-process lock still holds
        return
    import fcntl

    fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_UN)


@contextlib.contextmanager
def _directory_lock(directory: Path, local: threading.Lock) -> Iterator[None]:
    """One uploader per directory: this process's threads, and other processes (POSIX)."""
    with local:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / LOCK, "a+b") as handle:
            _flock(handle, True)
            try:
                yield
            finally:
                _flock(handle, False)


class Uploader(FileUploader):
    """Uploads the files of one proof directory; safe to run again at any point.

    Each file goes as :class:`~dvbench._transfer.FileUploader` sends it; this adds the
    directory's order, its experiment, the challenges' files and the artifact list.

    Args:
        client: an online :class:`~dvbench.Client`.
        manifest: the directory's manifest (created or loaded).
        progress: where to count bytes (a quiet one if None).
        parallel: parts of one file in flight at once (default: the client's
            ``settings.parallel``, ``DVBENCH_UPLOAD_PARALLEL``; unset, 1 to the platform
            and 4 straight to object storage).
    """

    @property
    def challenged_only(self) -> bool:
        """Whether only the files the platform's challenges ask for are sent."""
        return str(getattr(self.client.settings, "upload_files", "all")) == "challenged"

    # --- discovery ----------------------------------------------------------------------
    def scan(self, *, final: bool) -> list[str]:
        """Files to consider, in upload order: ``files/`` first, the transcript last.

        While training (``final=False``) only ``files/`` is scanned: those files are
        written atomically and never change, while the transcript, probes and program
        are still being written.
        """
        found: list[str] = []
        files_dir = self.directory / "files"
        if files_dir.is_dir():
            found += sorted(f"files/{p.name}" for p in files_dir.iterdir() if p.is_file())
        if self.challenged_only:
            found = []  # sent when, and only if, a challenge asks for them
        if final:
            found += sorted(
                p.name for p in self.directory.iterdir() if p.is_file() and p.name != TRANSCRIPT
            )
            model_dir = self.directory / "model"
            if model_dir.is_dir():
                found += sorted(f"model/{p.name}" for p in model_dir.iterdir() if p.is_file())
            if (self.directory / TRANSCRIPT).is_file():
                found.append(TRANSCRIPT)
        return [name for name in found if kind_of(name) is not None]

    # --- the whole directory ------------------------------------------------------------
    def run(self, *, final: bool) -> SyncResult:
        """Upload what is there; with ``final``, the transcript too, then attach the files.

        Raises:
            UploadError: the run has not finished (``final`` on an unfinished run), or a
                file could not be uploaded.
            APIError, NetworkError: as the platform answered, after retries.
        """
        with _directory_lock(self.directory, self._local_lock):
            if final and not self.manifest.data.get("finished"):
                raise UploadError(
                    f"the run in {self.directory} has not finished (its transcript was never "
                    "closed), so the platform would reject it; finish() it, or sync files "
                    "only with `dvbench sync --partial`",
                    directory=str(self.directory),
                )
            names = self.scan(final=final)
            if names:
                self._prepare_experiment()
            if final:
                done = ("complete", "deduplicated", "empty")
                self.progress.total = sum(
                    (self.directory / n).stat().st_size
                    for n in names
                    if self.manifest.files.get(n, {}).get("status") not in done
                )
            others = [name for name in names if name != TRANSCRIPT]
            if others:
                self.known()  # listed once, before the workers share it
                self._upload_all(others)
            if final and TRANSCRIPT in names:
                self.upload(TRANSCRIPT)
                entry = self.manifest.files[TRANSCRIPT]
                proof = entry.get("proof")
                self.manifest.update(proof=proof)
                self._result.proof_id = int(proof) if proof is not None else None
                answered = self._answer() if self.challenged_only else True
                self._attach()
                self._result.complete = answered
                if answered:
                    self.manifest.update(synced=utc_timestamp())
            self._result.attached = (
                self.manifest.data.get("attached") is True
                if self.manifest.data.get("attached") is not None
                else None
            )
            if self._result.proof_id is not None:
                # The proof's page in the web UI: its verdict, steps and checks.
                self._result.proof_url = f"{self.client.base_url}/proofs/{self._result.proof_id}/"
            return self._result

    def _upload_all(self, names: list[str]) -> None:
        """Upload files on a few threads: most are small, so round trips dominate."""
        workers = min(self.client.settings.concurrency, len(names))
        if workers <= 1:
            for name in names:
                self.upload(name)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="dvbench-upload") as pool:
            futures = [pool.submit(self.upload, name) for name in names]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _prepare_experiment(self) -> None:
        """Register an experiment declared offline, and check the spec digest it was bound to."""
        data = self.manifest.data
        if data.get("experiment_checked"):
            return
        name, digest = self.manifest.experiment, str(data.get("spec_digest") or "")
        try:
            specs = self.client.get(f"experiments/{name}/specs/")
        except NotFoundError:
            spec = data.get("spec")
            if not spec:
                raise
            self.client.create_experiment(name, spec)
            specs = self.client.get(f"experiments/{name}/specs/")
        digests = {s.get("digest") for s in specs} if isinstance(specs, list) else set()
        if digest and digest not in digests:
            raise UploadError(
                f"the transcript is bound to spec digest {digest}, which is no version of "
                f"{name}'s declared spec; the platform would reject it. Register that spec "
                "version (e.g. with `dvbench experiments create`), or re-run the training",
                directory=str(self.directory),
            )
        self.manifest.update(experiment_checked=True)

    def _wait_for_challenges(self, proof: int) -> str:
        """Poll the proof until the platform has verified it; its status then."""
        deadline = time.monotonic() + float(getattr(self.client.settings, "challenge_wait", 0))
        pause = 0.2
        while True:
            status = str(self.client.get_proof(proof).get("status"))
            if status not in ("pending", "verifying") or time.monotonic() >= deadline:
                return status
            time.sleep(pause)
            pause = min(pause * 1.5, 2.0)

    def _answer(self) -> bool:
        """Send the files the proof's pending challenges need; False if not yet drawn.

        Returns:
            True when there is nothing (more) to answer: the challenges' files are sent,
            or the proof has no challenges (no program to replay, or already final).
        """
        proof = self.manifest.data.get("proof")
        if proof is None:
            return False
        status = self._wait_for_challenges(int(proof))
        if status in ("pending", "verifying"):
            note = (
                f"proof {proof} is still {status}: its challenges are not drawn yet; "
                f"run `dvbench sync {self.directory}` later to answer them"
            )
            log.warning("dvbench: %s", note)
            self._result.notes.append(note)
            return False
        if status != "challenged":
            return True
        needed: set[str] = set()
        for challenge in self.client.paginate(
            f"proofs/{int(proof)}/challenges/", {"status": "pending"}
        ):
            needed.update(str(name) for name in challenge.get("needed_files") or [])
        missing = sorted(name for name in needed if not (self.directory / name).is_file())
        if missing:
            raise UploadError(
                f"the platform's challenges of proof {proof} need {', '.join(missing)}, which "
                f"{self.directory} does not hold; unanswered, the challenges expire and the "
                "proof is rejected",
                directory=str(self.directory),
            )
        names = sorted(name for name in needed if kind_of(name) is not None)
        self._result.challenged_files = len(names)
        if names:
            self.progress.total = (self.progress.total or 0) + sum(
                (self.directory / name).stat().st_size for name in names
            )
            self.known()
            self._upload_all(names)
        return True

    def _attach(self) -> None:
        """List the proof's files on the platform, so its replays can find them.

        Sends the files not attached yet (the manifest's ``attached_files``); attaching
        is idempotent on the platform, so a retry after a lost answer is harmless.
        """
        data = self.manifest.data
        proof = data.get("proof")
        if proof is None or data.get("attached") in ("unsupported", "final"):
            return
        done = set(data.get("attached_files") or [])
        files = [
            {"name": name, "kind": e["kind"], "sha256": e["sha256"], "size": e["size"]}
            for name, e in sorted(self.manifest.files.items())
            if e.get("status") in ("complete", "deduplicated")
            and e.get("kind") != "transcript"
            and name not in done
        ]
        if not files and data.get("attached") is True:
            return
        try:
            self.client.post(f"proofs/{int(proof)}/artifacts/", {"files": files})
        except ConflictError as error:
            if error.code != "proof_final":
                raise
            # The verdict is in (a proof with nothing to replay is final at ingest):
            # its files no longer matter, and they are stored all the same.
            self.manifest.update(attached="final")
            return
        except APIError as error:
            # The proof was just filed, so a 404 or 405 means a platform without the
            # route: the files are uploaded and content-addressed all the same.
            if error.status_code in (404, 405):
                if data.get("attached") != "unsupported":
                    log.info("dvbench: this platform has no proof artifact list; skipped")
                self.manifest.update(attached="unsupported")
                return
            raise
        self.manifest.update(
            attached=True, attached_files=sorted(done | {str(f["name"]) for f in files})
        )


def release(directory: Path) -> None:
    """Remove a synced temporary proof directory."""
    shutil.rmtree(directory, ignore_errors=True)


def sync_directory(
    client: Api,
    directory: Path,
    *,
    progress: bool | None = None,
    partial: bool = False,
    experiment: str | None = None,
    wait: bool = False,
    timeout: float = 1800.0,
    parallel: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> SyncResult:
    """Upload a proof directory incrementally; see the module docstring.

    Args:
        client: an online client.
        directory: a proof directory with ``dvbench-sync.json`` (or, with ``experiment``,
            a proof directory written by zkdv alone).
        progress: draw the progress bar (default: when stderr is a terminal).
        partial: upload the files of an unfinished run, not its transcript.
        experiment: ``owner/name`` for a directory without a manifest; its spec digest is
            read from the transcript's root record.
        wait: wait (up to ``timeout`` seconds) for the certificate, answering challenges
            drawn meanwhile; ``result.verdict`` says PASSED, FAILED, error or pending.
            Without it the verdict is asked once (usually still pending).
        parallel: parts of one file in flight at once (default
            ``DVBENCH_UPLOAD_PARALLEL``; unset, 1 to the platform, in order, and 4
            straight to object storage).
        on_progress: called as ``on_progress(done, total)`` in bytes after every part
            sent or found on the platform and every deduplicated file, from the
            uploading threads.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UploadError(f"{directory} is not a directory", directory=str(directory))
    if not (directory / MANIFEST).exists() and experiment is not None:
        adopt_directory(directory, experiment, client.base_url)
    manifest = Manifest.load(directory)
    if client.offline:
        return SyncResult(directory, manifest.experiment, offline=True)
    bar = Progress(enabled=progress, callback=on_progress)
    uploader = Uploader(client, manifest, bar, parallel=parallel)
    try:
        result = uploader.run(final=not partial)
    except DVBenchError as error:
        bar.close()
        if not isinstance(error, UploadError):
            error.add_note(
                f"The proof is kept in {directory}; run `dvbench sync {directory}` again to "
                "resume the upload."
            )
        raise
    bar.close()
    if not partial:
        settle(client, uploader, result, wait=wait, timeout=timeout)
    if result.complete and manifest.data.get("ephemeral"):
        release(directory)
        result.released = True
    return result


def settle(
    client: Api, uploader: Uploader, result: SyncResult, *, wait: bool, timeout: float
) -> Verdict | None:
    """Set ``result.verdict``: asked once, or (``wait``) polled until final or ``timeout``.

    While waiting, challenges the platform draws meanwhile are answered (the directory is
    still there: it is released only afterwards). Never raises for the verdict itself: a
    failure to ask is a note, and the caller decides what FAILED means.
    """
    if result.proof_id is None:
        return None
    if not wait:
        try:
            result.verdict = client.verdict(result.proof_id)
        except DVBenchError as error:
            note = f"could not ask for the verdict of proof {result.proof_id}: {error}"
            log.warning("dvbench: %s", note)
            result.notes.append(note)
        return result.verdict
    uploader.progress = Progress(enabled=False)

    def answer() -> None:
        if not result.complete:
            uploader.run(final=True)

    result.verdict = client.wait_for_verdict(result.proof_id, timeout=timeout, poll=answer)
    return result.verdict
