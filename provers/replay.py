"""Replay challenged steps of a stored transcript: the framework-neutral prover core.

Given a proof directory (the transcript, its probe sidecar, snapshot and batch files)
and a *transition* (the attested program, loaded by ``provers.jax_replay`` or
``provers.torch_replay``), :func:`replay` checks one challenge:

1. the snapshot files of the latest snapshot at or before the challenged step hash to
   the roots the transcript committed for it (``snapshot_mismatch`` otherwise);
2. every batch file from there to the challenged step hashes to its step's committed
   batch root (``batch_mismatch``);
3. the transition is replayed step by step from the snapshot; after each step the
   replayed post-update state is compared with the committed one: *exactly* by state
   root (what the same artifact on the same thread count reproduces), otherwise by the
   pre-update, post-update and delta probes within the run's ``FloatTolerance``
   (``replay_mismatch`` names the step, the probe and the coordinate).

Replaying a whole window (snapshot to the step before the next snapshot) checks every
step in it. The function is pure: no Django, no Celery, no network.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zkdv.batch import commit_batch
from zkdv.config import FloatTolerance, ZKDVConfig
from zkdv.files import TREES, batch_path, read_batch, read_state, snapshot_path
from zkdv.merkle import LeafSpec, commit_state
from zkdv.probes import ProbeSet
from zkdv.records import PROBES_FILE, iter_records
from zkdv.verify import verify_transcript

__all__ = ["ReplayVerdict", "StepEvidence", "Transcript", "Transition", "replay"]

Leaves = list[tuple[str, np.ndarray]]
#: ``(params, opt_state, buffers, batch, step) -> (params, opt_state, buffers, deltas)``;
#: ``step`` is the step's record: its index ``i`` and whatever else the transition reads
#: from it (a Torch step's ``hp``: the optimizer options its schedulers set).
Transition = Callable[
    [Leaves, Leaves, Leaves, np.ndarray, dict[str, Any]], tuple[Leaves, Leaves, Leaves, Leaves]
]
ROOT_KEYS = ("p", "o", "b")


@dataclass(frozen=True)
class StepEvidence:
    """What the replay found at one step."""

    step: int
    batch_ok: bool
    exact: bool
    probe_excess: float | None  # worst |diff| - bound over the probes; <= 0 is within tolerance
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch_ok": self.batch_ok,
            "exact": self.exact,
            "probe_excess": self.probe_excess,
            "ok": self.ok,
        }


@dataclass
class ReplayVerdict:
    """The verdict on one challenge, with evidence for every check made."""

    ok: bool
    step: int
    start: int | None = None
    reason: str | None = None
    message: str | None = None
    snapshot_ok: bool | None = None
    evidence: list[StepEvidence] = field(default_factory=list)
    tolerance: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "step": self.step,
            "start": self.start,
            "reason": self.reason,
            "message": self.message,
            "snapshot_ok": self.snapshot_ok,
            "evidence": [e.to_dict() for e in self.evidence],
            "tolerance": self.tolerance,
        }


class ReplayError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Transcript:
    """A verified transcript indexed for replay."""

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
        )

    def snapshot_before(self, step: int) -> int:
        """The latest snapshot at or before ``step``."""
        candidates = [s for s in self.snapshots if s <= step]
        if not candidates:
            raise ReplayError(
                "no_snapshot", f"the transcript records no snapshot at or before step {step}"
            )
        return max(candidates)

    def committed_probes(self, step: int) -> np.ndarray | None:
        probe = self.steps[step].get("probe")
        if probe is None or self.probe_bytes is None:
            return None
        raw = self.probe_bytes[probe["off"] : probe["off"] + probe["len"]]
        return np.frombuffer(raw, dtype="<f4").reshape(3, -1)


def _roots(record: dict[str, Any]) -> tuple[bytes, ...]:
    return tuple(record[k] for k in ROOT_KEYS)


def _probe_excess(
    replayed: np.ndarray, committed: np.ndarray, tolerance: FloatTolerance
) -> tuple[float, int, int]:
    bound = tolerance.absolute + tolerance.relative * np.abs(committed.astype(np.float64))
    excess = np.abs(replayed.astype(np.float64) - committed.astype(np.float64)) - bound
    excess = np.where(np.isnan(excess), np.inf, excess)
    flat = int(np.argmax(excess))
    row, column = divmod(flat, excess.shape[1])
    return float(excess.reshape(-1)[flat]), row, column


def _load_snapshot(transcript: Transcript, start: int) -> tuple[Leaves, Leaves, Leaves]:
    expected = _roots(transcript.snapshots[start]["roots"])
    loaded: list[Leaves] = []
    for tree, specs, root in zip(
        TREES, (transcript.params, transcript.opt_state, transcript.buffers), expected, strict=True
    ):
        file = snapshot_path(transcript.path, start, tree)
        if not file.exists():
            raise ReplayError(
                "missing_file", f"snapshot file {file.name} for step {start} was not provided"
            )
        try:
            leaves, commitment = read_state(file, specs, transcript.config.chunk_bytes)
        except ValueError as error:
            raise ReplayError("snapshot_mismatch", str(error)) from None
        if commitment.root != root:
            raise ReplayError(
                "snapshot_mismatch",
                f"snapshot file {file.name} does not hash to the {tree} root committed for step {start}",
            )
        loaded.append([(p, np.array(a)) for p, a in leaves])
    return loaded[0], loaded[1], loaded[2]


def replay(
    proof_dir: str | os.PathLike[str] | Transcript,
    *,
    step: int,
    transition: Transition,
    through: int | None = None,
) -> ReplayVerdict:
    """Replay from the snapshot preceding ``step`` through ``through`` (default ``step``).

    Args:
        proof_dir: the proof directory (or an already loaded :class:`Transcript`).
        step: the challenged step.
        transition: the attested program, as a state transition.
        through: replay further, up to this step, to check a whole window.

    Returns:
        A verdict with per-step evidence; never raises for bad evidence.
    """
    verdict = ReplayVerdict(ok=False, step=step)
    try:
        transcript = proof_dir if isinstance(proof_dir, Transcript) else Transcript.load(proof_dir)
        tol = transcript.config.tolerance
        verdict.tolerance = tol.to_dict()
        end = step if through is None else through
        if step not in transcript.steps or end not in transcript.steps or end < step:
            raise ReplayError(
                "no_such_step",
                f"the transcript has no step {step}"
                if step not in transcript.steps
                else f"the transcript has no step {end}",
            )
        start = transcript.snapshot_before(step)
        verdict.start = start
        params, opt_state, buffers = _load_snapshot(transcript, start)
        verdict.snapshot_ok = True
        for k in range(start, end + 1):
            record = transcript.steps[k]
            file = batch_path(transcript.path, k)
            if not file.exists():
                raise ReplayError(
                    "missing_file", f"batch file {file.name} for step {k} was not provided"
                )
            try:
                batch = np.array(read_batch(file))
            except ValueError as error:
                raise ReplayError("batch_mismatch", str(error)) from None
            if (
                commit_batch(batch, int(transcript.root["config"]["rolling_window"])).root
                != record["batch"]["root"]
            ):
                verdict.evidence.append(StepEvidence(k, False, False, None, False))
                raise ReplayError(
                    "batch_mismatch",
                    f"batch file {file.name} does not hash to step {k}'s committed batch root",
                )
            pre_params = params
            params, opt_state, buffers, deltas = transition(
                params, opt_state, buffers, batch, record
            )
            chunk = transcript.config.chunk_bytes
            replayed_roots = tuple(
                commit_state(leaves, chunk).root for leaves in (params, opt_state, buffers)
            )
            exact = replayed_roots == _roots(record["post"])
            excess: float | None = None
            ok = exact
            committed = transcript.committed_probes(k)
            if committed is not None:
                replayed = np.stack(
                    [
                        np.concatenate(
                            [
                                p.reshape(-1)
                                for p in transcript.probes.project_all([a for _, a in leaves])
                            ]
                        )
                        for leaves in (pre_params, params, deltas)
                    ]
                )
                excess, row, column = _probe_excess(replayed, committed, tol)
                if not exact and excess > 0:
                    names = ("pre-update", "post-update", "delta")
                    verdict.evidence.append(StepEvidence(k, True, exact, excess, False))
                    raise ReplayError(
                        "replay_mismatch",
                        f"step {k}: the replayed {names[row]} probe differs from the committed one at "
                        f"coordinate {column} by {excess:.3g} beyond tolerance (abs {tol.absolute:g}, rel {tol.relative:g})",
                    )
                ok = exact or excess <= 0
            elif not exact:
                verdict.evidence.append(StepEvidence(k, True, False, None, False))
                raise ReplayError(
                    "replay_mismatch",
                    f"step {k}: the replayed state does not reproduce the committed roots and the run has no probes to compare within tolerance",
                )
            verdict.evidence.append(StepEvidence(k, True, exact, excess, ok))
        verdict.ok = True
    except ReplayError as error:
        verdict.reason = error.reason
        verdict.message = error.message
    if verdict.snapshot_ok is None and verdict.reason == "snapshot_mismatch":
        verdict.snapshot_ok = False
    return verdict


def windows(transcript: Transcript) -> list[tuple[int, int]]:
    """``(first, last)`` steps of every snapshot window of the run."""
    starts = sorted(transcript.snapshots)
    last = max(transcript.steps) if transcript.steps else -1
    ends = [s - 1 for s in starts[1:]] + [last]
    return [(a, b) for a, b in zip(starts, ends, strict=True) if a <= b]
