"""The tape owner: one transcript's commitments, written in order, framework-free.

Frontends hand :class:`ZKDVCore` host (numpy) views of states and batches, or the
:class:`~zkdv.merkle.StateCommitment` of a state they hashed on its device
(:mod:`zkdv.device_merkle`); it computes the remaining commitments, writes the records
and decides sampled checks. It is used from the
pipeline's single commit thread for steps, and from the check thread for check
records, so appends are serialised by a lock.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zkdv.batch import as_batch, commit_batch, validate_window
from zkdv.config import GradientBounds, ZKDVConfig
from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import LeafSpec, PendingCommitment, StateCommitment, commit_state, start_commit
from zkdv.probes import ProbeSet
from zkdv.records import PROTOCOL_VERSION, TranscriptWriter
from zkdv.sampling import Challenge, Sampler

__all__ = ["ProgramInfo", "StateRoots", "StepResult", "ZKDVCore", "file_digest"]

Leaves = Sequence[tuple[str, np.ndarray]]
#: A state as host leaves, already committed (hashed on its device), or being hashed
#: (:meth:`ZKDVCore.start_commit`).
State = Leaves | StateCommitment | PendingCommitment


@dataclass(frozen=True)
class StateRoots:
    params: bytes
    opt_state: bytes
    buffers: bytes

    def to_record(self) -> dict[str, bytes]:
        return {"p": self.params, "o": self.opt_state, "b": self.buffers}


@dataclass(frozen=True)
class ProgramInfo:
    """The attested program artifact: its kind, exact bytes' digest and size."""

    kind: str
    digest: bytes
    size: int

    @classmethod
    def of(cls, kind: str, material: bytes | bytearray | memoryview) -> ProgramInfo:
        return cls(kind, hash_bytes(Domain.FILE, material), len(material))

    def to_record(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "bytes": self.size}


@dataclass(frozen=True)
class StepResult:
    record_hash: bytes
    roots: StateRoots
    challenge: Challenge | None
    params: StateCommitment
    opt_state: StateCommitment


def file_digest(data: bytes | bytearray | memoryview) -> bytes:
    return hash_bytes(Domain.FILE, data)


def environment(backend: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": sys.platform,
        "cpu_count": os.cpu_count() or 1,
        "backend": backend,
    }
    if extra:
        env.update(extra)
    return env


class ZKDVCore:
    """Own one transcript and its commitments.

    Args:
        path: proof directory.
        config: run configuration.
        prover: ``"whitebox-jax"`` or ``"whitebox-torch"``.
        rolling_window: words per rolling-hash window of a batch row.
        probe_ratio: fraction of each parameter leaf's last dimension kept by probes.
        snapshot_interval: steps between replay snapshots.
        max_in_flight: pipeline admission bound (recorded for the verifier's context).
        experiment: ``{"name": "owner/name", "spec_digest": hex}`` when bound to DVBench.
        background_writes: write the transcript, its probes and the files handed to
            :meth:`submit_file` on a writer thread (:class:`~zkdv.records.TranscriptWriter`
            with ``background=True``: what is committed when is said there); otherwise
            every record is written before the call that appends it returns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: ZKDVConfig,
        *,
        prover: str,
        rolling_window: int,
        probe_ratio: float,
        snapshot_interval: int,
        max_in_flight: int,
        experiment: dict[str, str] | None = None,
        background_writes: bool = False,
    ) -> None:
        self.path = Path(path)
        self.background_writes = background_writes
        self.config = config
        self.prover = prover
        self.rolling_window = rolling_window
        self.probe_ratio = probe_ratio
        self.snapshot_interval = snapshot_interval
        self.max_in_flight = max_in_flight
        self.experiment = experiment
        self._writer: TranscriptWriter | None = None
        self._lock = threading.Lock()
        self.probes: ProbeSet | None = None
        self.param_specs: tuple[LeafSpec, ...] = ()
        self.state_specs: tuple[LeafSpec, ...] = ()
        #: The leaves of the step's computed values (``schema.grad``), when committed.
        self.grad_specs: tuple[LeafSpec, ...] | None = None
        self.param_count = 0
        self.state_count = 0
        self.steps = 0
        self.checks = 0
        self.last_roots: StateRoots | None = None
        self.batch_cols = 0
        self.digest: bytes | None = None
        # The run's probe seed and clock. Drawn and read here so that a test can fix
        # both and compare two runs' transcripts byte for byte.
        self.probe_seed = secrets.token_bytes(16)
        self.clock: Callable[[], float] = time.time
        self._probe_lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._writer is not None

    def commit(self, leaves: State, *, parallel: bool = True) -> StateCommitment:
        if isinstance(leaves, StateCommitment):
            return leaves
        if isinstance(leaves, PendingCommitment):
            return leaves.result()
        return commit_state(leaves, self.config.chunk_bytes, parallel=parallel)

    def start_commit(self, leaves: Leaves) -> PendingCommitment:
        """:meth:`commit` on the shared hashing pool, returning at once (the arrays must
        not change until the result is read, or :meth:`PendingCommitment.wait` returns):
        the caller's own work runs beside the hashing."""
        return start_commit(leaves, self.config.chunk_bytes)

    def probe_set(self, specs: Sequence[LeafSpec]) -> ProbeSet:
        """The run's probes for parameters of ``specs`` (created once, from the probe seed).

        A device path needs them before the first step is committed; :meth:`open` uses
        the same set.
        """
        with self._probe_lock:
            if self.probes is None or self.probes.specs != tuple(specs):
                self.probes = ProbeSet.create(specs, self.probe_ratio, self.probe_seed)
            return self.probes

    def open(
        self,
        *,
        params: State,
        opt_state: State,
        buffers: State,
        batch_cols: int,
        program: ProgramInfo | None,
        env: dict[str, Any] | None = None,
        shardings: dict[str, Any] | None = None,
        grad: Sequence[LeafSpec] | None = None,
        bounds: GradientBounds | None = None,
        gradient_files: str = "always",
    ) -> StateRoots:
        """Write the root record, committing to the initial state.

        Args:
            grad: the leaves of every step's computed values (:mod:`zkdv.gradients`):
                the run commits them, and its root records them as ``schema.grad``.
            bounds: their bounds, recorded as ``config.bounds``: the configuration's
                when it sets them, else these (the frontend's default for its program).
            gradient_files: whether each step's computed values are kept as files
                (``ZKDVConfig.gradient_files`` as resolved for the run), recorded as
                ``config.gradient_files``.
        """
        if self._writer is not None:
            raise RuntimeError("the transcript root is already written")
        validate_window(self.rolling_window, batch_cols)
        self.batch_cols = batch_cols
        committed = [self.commit(leaves) for leaves in (params, opt_state, buffers)]
        roots = StateRoots(*(c.root for c in committed))
        self.param_specs, self.state_specs = committed[0].specs, committed[1].specs
        self.param_count, self.state_count = committed[0].size, committed[1].size
        probe_seed = self.probe_seed
        self.probe_set(self.param_specs)
        self._sampler = Sampler(
            self.config.sampling_policy, param_count=self.param_count, state_count=self.state_count
        )
        schema: dict[str, Any] = {
            "params": [s.to_dict() for s in committed[0].specs],
            "opt_state": [s.to_dict() for s in committed[1].specs],
            "buffers": [s.to_dict() for s in committed[2].specs],
            "batch": {"cols": batch_cols, "dtype": "uint32"},
        }
        if shardings:
            schema["sharding"] = shardings
        config = {
            **self.config.to_dict(),
            "rolling_window": self.rolling_window,
            "probe_ratio": self.probe_ratio,
            "snapshot_interval": self.snapshot_interval,
            "max_in_flight": self.max_in_flight,
        }
        if grad is not None:
            self.grad_specs = tuple(grad)
            schema["grad"] = [s.to_dict() for s in self.grad_specs]
            chosen = self.config.gradient_bounds or bounds
            if chosen is None:
                raise RuntimeError("a run that commits computed values needs gradient bounds")
            config["bounds"] = chosen.to_dict()
            config["gradient_files"] = gradient_files
        root = {
            "t": "root",
            "v": PROTOCOL_VERSION,
            "prover": self.prover,
            "config": config,
            "program": program.to_record() if program else None,
            "schema": schema,
            "initial": roots.to_record(),
            "env": environment(self.prover, env),
            "experiment": self.experiment,
            "probe_seed": probe_seed,
            "created": self.clock(),
        }
        self._writer = TranscriptWriter(self.path, background=self.background_writes)
        with self._lock:
            self._writer.append(root, sync=True)
        self.last_roots = roots
        return roots

    def commit_step(
        self,
        step: int,
        *,
        batch: Any,
        params: State,
        opt_state: State,
        buffers: State,
        probes: Sequence[Sequence[np.ndarray]] | None,
        tokens: int | None = None,
        flops: float | None = None,
        started: float | None = None,
        hyperparameters: list[dict[str, Any]] | None = None,
        grad: State | None = None,
    ) -> StepResult:
        """Commit one step's batch and post-update state; decide its sampled check.

        Args:
            probes: ``(pre, post, delta)`` probe arrays per parameter leaf, and with
                committed gradients ``grad`` too (the gradient leaves' probes, zeros for
                a parameter without a gradient), or None.
            grad: the step's computed values (:mod:`zkdv.gradients`), required when
                the root commits them.
            hyperparameters: the step's ``hp`` (Torch: each optimizer group's dynamic
                options as the step used them), or None.
        """
        writer = self._require_open()
        if step != self.steps:
            raise RuntimeError(
                f"steps must be committed in order: expected {self.steps}, got {step}"
            )
        array = self._step_batch(step, batch)
        batch_commitment = commit_batch(array, self.rolling_window)
        committed = [self.commit(leaves) for leaves in (params, opt_state, buffers)]
        roots = StateRoots(*(c.root for c in committed))
        record: dict[str, Any] = {
            "t": "step",
            "i": step,
            "batch": batch_commitment.to_record(),
            "post": roots.to_record(),
            "probe": None,
            "tokens": self._step_tokens(tokens, array),
            "flops": None if flops is None else float(flops),
            "time": [float(started or self.clock()), self.clock()],
        }
        if hyperparameters is not None:
            record["hp"] = hyperparameters
        grad_root = self._grad_root(step, grad)
        if grad_root is not None:
            record["grad"] = grad_root
        with self._lock:
            if probes is not None:
                record["probe"] = writer.append_probes(_packed_probes(probes))
            record_hash = writer.append(record)
        self.steps += 1
        self.last_roots = roots
        challenge = self._sampler.decide(step, record_hash)
        return StepResult(record_hash, roots, challenge, committed[0], committed[1])

    def _step_batch(self, step: int, batch: Any) -> np.ndarray:
        """The step's batch as uint32 rows, as wide as the first step's."""
        array = as_batch(batch)
        if array.shape[1] != self.batch_cols:
            raise ValueError(
                f"step {step} batch has {array.shape[1]} uint32 columns; the first step fixed "
                f"{self.batch_cols} (the batch representation must stay compatible)"
            )
        return array

    def _step_tokens(self, tokens: int | None, array: np.ndarray) -> int:
        """The step's ``tokens``: the frontend's count, else counted from the batch."""
        # Without a frontend's count: the committed rows are the examples, and a
        # packed token row holds one word per token.
        return int(
            tokens
            if tokens is not None
            else array.shape[0]
            if self.config.token_unit == "examples"  # noqa: S105 - a unit, not a secret
            else array.size
        )

    def _grad_root(self, step: int, grad: State | None) -> bytes | None:
        """The root of the step's computed values, which the root record may require."""
        if self.grad_specs is not None:
            if grad is None:
                raise RuntimeError(f"step {step} has no computed values; the root commits them")
            computed = self.commit(grad)
            if computed.specs != self.grad_specs:
                raise RuntimeError(
                    f"step {step}'s computed values have another layout than the root's schema.grad"
                )
            return computed.root
        if grad is not None:
            raise RuntimeError("computed values are committed only when the root declares them")
        return None

    def record_check(
        self,
        challenge: Challenge,
        *,
        committed_delta: float,
        replayed_delta: float,
        committed_state: float,
        replayed_state: float,
        replay_from: int,
        replayed_steps: int,
        gradient_within: bool | None = None,
    ) -> bool:
        """Write a check record; returns whether it passed.

        It passes when both coordinates are within tolerance and, where the check
        judged the step's whole gradient (``gradient_within`` is not None), that
        gradient lay within the bounds of the committed one.
        """
        writer = self._require_open()
        tol = self.config.tolerance
        ok = (
            tol.close(float(replayed_delta), float(committed_delta))
            and tol.close(float(replayed_state), float(committed_state))
            and gradient_within is not False
        )
        record: dict[str, Any] = {
            "t": "check",
            "i": challenge.step,
            "param": {
                "index": challenge.param_index,
                "committed": float(committed_delta),
                "replayed": float(replayed_delta),
            },
            "state": {
                "index": challenge.state_index,
                "committed": float(committed_state),
                "replayed": float(replayed_state),
            },
            "from": int(replay_from),
            "replayed": int(replayed_steps),
            "ok": bool(ok),
        }
        if gradient_within is not None:
            record["grad"] = bool(gradient_within)
        with self._lock:
            writer.append(record, sync=True)
            self.checks += 1
        return ok

    def record_snapshot(
        self, step: int, roots: StateRoots, files: dict[str, bytes | bytearray]
    ) -> None:
        """Commit the pre-state of ``step`` and the files kept for the platform."""
        writer = self._require_open()
        entries = {
            name: {"digest": file_digest(data), "bytes": len(data)} for name, data in files.items()
        }
        with self._lock:
            writer.append(
                {"t": "snap", "i": step, "roots": roots.to_record(), "files": entries}, sync=True
            )

    def submit_file(self, job: Callable[[], object], nbytes: int = 0) -> None:
        """Run a file write on the transcript's writer, before any record appended later.

        Args:
            job: writes one file the next records refer to (a committed batch).
            nbytes: the memory the job holds until it runs (the writer's back-pressure).
        """
        self._require_open().submit(job, nbytes)

    def flush(self) -> None:
        """Wait until every record and file queued so far is written (committed)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> bytes:
        """Write the close record; returns the transcript digest."""
        writer = self._require_open()
        assert self.last_roots is not None
        with self._lock:
            try:
                self.digest = writer.append(
                    {
                        "t": "close",
                        "steps": self.steps,
                        "checks": self.checks,
                        "final": self.last_roots.to_record(),
                    },
                    sync=True,
                )
            finally:
                writer.close()
        return self.digest

    def abort(self) -> None:
        """Release the file without a close record (the transcript stays incomplete)."""
        if self._writer is not None:
            self._writer.close()

    def _require_open(self) -> TranscriptWriter:
        if self._writer is None:
            raise RuntimeError("the transcript root has not been written yet")
        return self._writer


def _packed_probes(probes: Sequence[Sequence[np.ndarray]]) -> memoryview:
    """A step's probe arrays, flattened part after part, as little-endian float32 bytes."""
    packed = np.concatenate(
        [np.concatenate([np.asarray(p, dtype="<f4").reshape(-1) for p in part]) for part in probes]
    )
    return packed.view(np.uint8).data
