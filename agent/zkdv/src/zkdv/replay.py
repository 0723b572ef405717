"""The replay interface a frontend offers verifiers: its attested step as a transition.

A verifier (the platform's provers, ``python -m zkdv calibrate``) rebuilds a run's step
from the proof directory alone, through the frontend's public replay module
(:mod:`zkdv.torch.replay`; :mod:`zkdv.jax.replay`), as a :class:`Transition` over host
leaves in the transcript's schema order. This module is framework-free: the transition
type, the error a loader raises, the verified :class:`Transcript` with its files (each
checked against its commitment as it is read), and reading the committed program.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zkdv.batch import commit_batch
from zkdv.config import GradientBounds, ZKDVConfig
from zkdv.errors import TranscriptError
from zkdv.files import (
    TREES,
    batch_path,
    gradient_path,
    program_file,
    read_batch,
    read_state,
    snapshot_path,
)
from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import LeafSpec
from zkdv.probes import ProbeSet
from zkdv.records import PROBES_FILE, iter_records
from zkdv.verify import verify_transcript

__all__ = [
    "ROOT_KEYS",
    "Apply",
    "Compute",
    "Leaves",
    "ReplayError",
    "Step",
    "Transcript",
    "Transition",
    "program_material",
    "root_record",
    "roots",
]

Leaves = list[tuple[str, np.ndarray]]
#: ``(params, opt_state, buffers, batch, step) -> (params, opt_state, buffers, deltas)``;
#: ``step`` is the step's record: its index ``i`` and whatever else the transition reads
#: from it (a Torch step's ``hp``: the optimizer options its schedulers set).
Step = Callable[
    [Leaves, Leaves, Leaves, np.ndarray, dict[str, Any]], tuple[Leaves, Leaves, Leaves, Leaves]
]
#: ``(params, opt_state, buffers, batch, step) -> computed values`` (named as the root's
#: ``schema.grad``, in its order; :mod:`zkdv.gradients`).
Compute = Callable[[Leaves, Leaves, Leaves, np.ndarray, dict[str, Any]], Leaves]
#: ``(params, opt_state, buffers, committed computed values, step) -> (params, opt_state,
#: buffers, deltas)`` after the step: the optimizer applied to the committed gradient, and
#: the parameters' update as the frontend commits its delta probe.
Apply = Callable[
    [Leaves, Leaves, Leaves, Leaves, dict[str, Any]], tuple[Leaves, Leaves, Leaves, Leaves]
]


class ReplayError(Exception):
    """Why a step cannot be replayed: a reason code and a precise message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Transition:
    """A proof's attested step, as a frontend's replay module rebuilds it.

    Calling it runs the whole step (:attr:`step`). A run that commits its gradients
    is replayed in two halves instead: :attr:`compute` (the gradient program) and
    :attr:`apply` (the optimizer on the committed values); :attr:`canonical` says
    whether ``apply`` is bitwise reproducible on any hardware.
    """

    step: Step
    compute: Compute | None = None
    apply: Apply | None = None
    canonical: bool = False
    #: What every step record's ``tokens`` must hold: the count, in the root's
    #: ``config.token_unit``, of the batch the program takes (its shapes are fixed by the
    #: program), times the ranks that each train one such batch. None where the frontend
    #: cannot say; then the records' counts are not checked.
    tokens: int | None = None
    #: What every step record's ``flops`` must hold, recounted from the committed
    #: program (or the SDK's estimate, ``6 x parameters x tokens``, where it recorded
    #: one). None where the frontend cannot count; then the records' counts are not
    #: checked.
    flops: float | None = None

    def __call__(
        self,
        params: Leaves,
        opt_state: Leaves,
        buffers: Leaves,
        batch: np.ndarray,
        record: dict[str, Any],
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        return self.step(params, opt_state, buffers, batch, record)


@dataclass
class Transcript:
    """A verified transcript indexed for replay: its records, and its files checked
    against their commitments as they are read."""

    path: Path
    root: dict[str, Any]
    steps: dict[int, dict[str, Any]]
    snapshots: dict[int, dict[str, Any]]
    config: ZKDVConfig
    params: tuple[LeafSpec, ...]
    opt_state: tuple[LeafSpec, ...]
    buffers: tuple[LeafSpec, ...]
    probes: ProbeSet
    probe_bytes: bytes | None
    #: The step's computed values (``schema.grad``): None for a run that does not
    #: commit its gradients.
    grad: tuple[LeafSpec, ...] | None = None

    @classmethod
    def load(cls, proof_dir: str | os.PathLike[str]) -> Transcript:
        """Load and verify a proof directory; raises ``ReplayError`` if it is invalid."""
        path = Path(proof_dir)
        report = verify_transcript(path)
        if not report.ok:
            raise ReplayError(
                "invalid_transcript", f"the transcript is rejected: {report.summary()}"
            )
        steps: dict[int, dict[str, Any]] = {}
        snapshots: dict[int, dict[str, Any]] = {}
        root: dict[str, Any] = {}
        for record in iter_records(path):
            kind = record.data.get("t")
            if kind == "root":
                root = record.data
            elif kind == "step":
                steps[record.data["i"]] = record.data
            elif kind == "snap":
                snapshots[record.data["i"]] = record.data
        schema = root["schema"]
        specs = [
            tuple(LeafSpec.from_dict(s) for s in schema[k])
            for k in ("params", "opt_state", "buffers")
        ]
        config = ZKDVConfig.from_dict(root["config"])
        grad = schema.get("grad")
        probe_file = path / PROBES_FILE
        return cls(
            path=path,
            root=root,
            steps=steps,
            snapshots=snapshots,
            config=config,
            params=specs[0],
            opt_state=specs[1],
            buffers=specs[2],
            probes=ProbeSet.create(
                specs[0], float(root["config"]["probe_ratio"]), root["probe_seed"]
            ),
            probe_bytes=probe_file.read_bytes() if probe_file.exists() else None,
            grad=None if grad is None else tuple(LeafSpec.from_dict(s) for s in grad),
        )

    @property
    def bounds(self) -> GradientBounds:
        """The run's gradient bounds (a run that commits its gradients)."""
        bounds = self.config.gradient_bounds
        if bounds is None:
            raise ReplayError("invalid_transcript", "the root record commits no gradient bounds")
        return bounds

    @property
    def keeps_gradient_files(self) -> bool:
        """Whether the run kept each step's computed values as ``files/grad-<step>.bin``
        (the root's ``config.gradient_files``; ``ZKDVConfig.gradient_files``). Where it
        did not, a replay must recompute them bit for bit."""
        return bool(self.root["config"].get("gradient_files", "always") != "never")

    def snapshot_before(self, step: int) -> int:
        """The latest snapshot at or before ``step``."""
        candidates = [s for s in self.snapshots if s <= step]
        if not candidates:
            raise ReplayError(
                "no_snapshot", f"the transcript records no snapshot at or before step {step}"
            )
        return max(candidates)

    def committed_probes(self, step: int) -> np.ndarray | None:
        """The step's committed probes: rows pre, post, delta (and grad)."""
        probe = self.steps[step].get("probe")
        if probe is None or self.probe_bytes is None:
            return None
        raw = self.probe_bytes[probe["off"] : probe["off"] + probe["len"]]
        return np.frombuffer(raw, dtype="<f4").reshape(3 if self.grad is None else 4, -1)

    def committed_computed(self, step: int) -> Leaves:
        """The committed computed values of ``step``, checked against its ``grad`` root.

        Raises:
            ReplayError: ``missing_file`` without the file; ``gradient_mismatch`` when
                it does not hash to the committed root (or has another size).
        """
        assert self.grad is not None
        file = gradient_path(self.path, step)
        if not file.exists():
            raise ReplayError(
                "missing_file", f"gradient file {file.name} for step {step} was not provided"
            )
        try:
            leaves, commitment = read_state(file, self.grad, self.config.chunk_bytes)
        except ValueError as error:
            raise ReplayError("gradient_mismatch", str(error)) from None
        if commitment.root != self.steps[step]["grad"]:
            raise ReplayError(
                "gradient_mismatch",
                f"gradient file {file.name} does not hash to step {step}'s committed grad root",
            )
        return [(p, np.array(a)) for p, a in leaves]

    def snapshot(self, start: int) -> tuple[Leaves, Leaves, Leaves]:
        """The pre-state of snapshot step ``start``, each file checked against its roots.

        Raises:
            ReplayError: ``missing_file``, or ``snapshot_mismatch`` naming the file.
        """
        expected = roots(self.snapshots[start]["roots"])
        loaded: list[Leaves] = []
        for tree, specs, root in zip(
            TREES, (self.params, self.opt_state, self.buffers), expected, strict=True
        ):
            file = snapshot_path(self.path, start, tree)
            if not file.exists():
                raise ReplayError(
                    "missing_file", f"snapshot file {file.name} for step {start} was not provided"
                )
            try:
                leaves, commitment = read_state(file, specs, self.config.chunk_bytes)
            except ValueError as error:
                raise ReplayError("snapshot_mismatch", str(error)) from None
            if commitment.root != root:
                raise ReplayError(
                    "snapshot_mismatch",
                    f"snapshot file {file.name} does not hash to the {tree} root committed for "
                    f"step {start}",
                )
            loaded.append([(p, np.array(a)) for p, a in leaves])
        return loaded[0], loaded[1], loaded[2]

    def batch(self, step: int) -> np.ndarray:
        """Step ``step``'s batch file, checked against its committed batch root.

        Raises:
            ReplayError: ``missing_file``, or ``batch_mismatch`` naming the file.
        """
        file = batch_path(self.path, step)
        if not file.exists():
            raise ReplayError(
                "missing_file", f"batch file {file.name} for step {step} was not provided"
            )
        try:
            batch = np.array(read_batch(file))
        except ValueError as error:
            raise ReplayError("batch_mismatch", str(error)) from None
        window = int(self.root["config"]["rolling_window"])
        if commit_batch(batch, window).root != self.steps[step]["batch"]["root"]:
            raise ReplayError(
                "batch_mismatch",
                f"batch file {file.name} does not hash to step {step}'s committed batch root",
            )
        return batch


#: The state roots' keys in a record (parameters, optimizer state, buffers).
ROOT_KEYS = ("p", "o", "b")


def roots(record: dict[str, Any]) -> tuple[bytes, ...]:
    """A record's three state roots, in :data:`~zkdv.files.TREES` order."""
    return tuple(record[k] for k in ROOT_KEYS)


def root_record(proof_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The root record of a proof directory's transcript.

    Raises:
        ReplayError: ``invalid_transcript`` when there is none.
    """
    try:
        for record in iter_records(proof_dir):
            if record.data.get("t") == "root":
                return record.data
            break
    except (OSError, TranscriptError) as error:
        raise ReplayError("invalid_transcript", f"the transcript cannot be read: {error}") from None
    raise ReplayError("invalid_transcript", "the transcript does not start with a root record")


def program_material(
    proof_dir: str | os.PathLike[str], root: dict[str, Any], kinds: tuple[str, ...]
) -> tuple[str, bytes]:
    """The attested program's bytes, checked against the root record's digest.

    Args:
        proof_dir: the proof directory holding the artifact file.
        root: its root record.
        kinds: the program kinds the caller can run.

    Returns:
        ``(kind, bytes)``.

    Raises:
        ReplayError: ``program_mismatch`` when the root commits no program of an
            accepted kind or the file does not hash to its digest, ``missing_file``
            when the file is absent.
    """
    program = root.get("program")
    if not isinstance(program, dict) or program.get("kind") not in kinds:
        kind = program.get("kind") if isinstance(program, dict) else None
        raise ReplayError(
            "program_mismatch",
            f"the root record commits program kind {kind!r}; this prover runs {list(kinds)}",
        )
    kind = str(program["kind"])
    path = os.path.join(os.fspath(proof_dir), program_file(kind))
    try:
        with open(path, "rb") as handle:
            material = handle.read()
    except FileNotFoundError:
        raise ReplayError(
            "missing_file", f"program artifact {os.path.basename(path)} was not provided"
        ) from None
    if hash_bytes(Domain.FILE, material) != program.get("digest"):
        raise ReplayError(
            "program_mismatch",
            f"program artifact {os.path.basename(path)} ({len(material)} bytes) does not "
            f"hash to the program digest committed in the root record",
        )
    return kind, material
