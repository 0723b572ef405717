"""Replay challenged steps of a stored transcript: the framework-neutral prover core.

Given a proof directory (the transcript, its probe sidecar, snapshot and batch files)
and a *transition* (the attested program, loaded by ``provers.jax_replay`` or
``provers.torch_replay``), :func:`replay` checks one challenge:

1. the snapshot files of the latest snapshot at or before the challenged step hash to
   the roots the transcript committed for it (``snapshot_mismatch`` otherwise);
2. every batch file from there to the challenged step hashes to its step's committed
   batch root (``batch_mismatch``);
3. the transition is replayed step by step from the snapshot.

   A run that commits its gradients (``schema.grad``, :mod:`zkdv.gradients`) is
   replayed in two halves at every step: the gradient program recomputes the step's
   computed values (the gradient, and what the forward pass writes) from the committed
   pre-state and batch, and they are compared with the committed ones
   (``files/grad-<step>.bin``, checked against the step's ``grad`` root) within the
   run's ``GradientBounds``; then the optimizer is applied to the *committed* values,
   and the post-update state must hash to the committed roots exactly: the optimizer's
   update is canonical, the same bits on any hardware. So honest rounding on other
   hardware stays in the gradient, where it is small and bounded, and nothing else can
   differ. (A run whose optimizer has no canonical form is compared by the probes
   instead, as below, from the same committed gradient.)

   An older run, without committed gradients, compares the replayed post-update state
   *exactly* by state root (what the same artifact on the same thread count
   reproduces), otherwise by the pre-update, post-update and delta probes within the
   run's ``FloatTolerance`` (``replay_mismatch`` names the step, the probe and the
   coordinate).

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
from zkdv.config import FloatTolerance, GradientBounds, ZKDVConfig
from zkdv.files import TREES, batch_path, gradient_path, read_batch, read_state, snapshot_path
from zkdv.gradients import Comparison, compare
from zkdv.merkle import LeafSpec, commit_state
from zkdv.probes import ProbeSet
from zkdv.records import PROBES_FILE, iter_records
from zkdv.verify import verify_transcript

__all__ = ["ReplayVerdict", "StepEvidence", "Transcript", "Transition", "replay"]

Leaves = list[tuple[str, np.ndarray]]
#: ``(params, opt_state, buffers, batch, step) -> (params, opt_state, buffers, deltas)``;
#: ``step`` is the step's record: its index ``i`` and whatever else the transition reads
#: from it (a Torch step's ``hp``: the optimizer options its schedulers set).
Step = Callable[
    [Leaves, Leaves, Leaves, np.ndarray, dict[str, Any]], tuple[Leaves, Leaves, Leaves, Leaves]
]
#: ``(params, opt_state, buffers, batch, step) -> computed values`` (named as the root's
#: ``schema.grad``, in its order).
Compute = Callable[[Leaves, Leaves, Leaves, np.ndarray, dict[str, Any]], Leaves]
#: ``(params, opt_state, buffers, committed computed values, step) -> (params, opt_state,
#: buffers, deltas)`` after the step: the optimizer applied to the committed gradient, and
#: the parameters' update as the frontend commits its delta probe.
Apply = Callable[
    [Leaves, Leaves, Leaves, Leaves, dict[str, Any]], tuple[Leaves, Leaves, Leaves, Leaves]
]
ROOT_KEYS = ("p", "o", "b")


@dataclass(frozen=True)
class Transition:
    """A proof's attested step, as a framework prover rebuilds it.

    Calling it runs the whole step (:attr:`step`). A run that commits its gradients
    is replayed in two halves instead: :attr:`compute` (the gradient program) and
    :attr:`apply` (the optimizer on the committed values); :attr:`canonical` says
    whether ``apply`` is bitwise reproducible on any hardware.
    """

    step: Step
    compute: Compute | None = None
    apply: Apply | None = None
    canonical: bool = False

    def __call__(
        self,
        params: Leaves,
        opt_state: Leaves,
        buffers: Leaves,
        batch: np.ndarray,
        record: dict[str, Any],
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        return self.step(params, opt_state, buffers, batch, record)


@dataclass(frozen=True)
class StepEvidence:
    """What the replay found at one step.

    ``exact``: the step was reproduced bit for bit (its post-update state roots and, for
    a run that commits gradients, its recomputed gradient). ``gradient``: for such a
    run, how the recomputed values compared with the committed ones (the worst leaf's
    divergence and bound, and ``margin``: divergence over bound, 0 when bitwise equal,
    above 1 beyond the bound).
    """

    step: int
    batch_ok: bool
    exact: bool
    probe_excess: float | None  # worst |diff| - bound over the probes; <= 0 is within tolerance
    ok: bool
    gradient: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch_ok": self.batch_ok,
            "exact": self.exact,
            "probe_excess": self.probe_excess,
            "ok": self.ok,
            "gradient": self.gradient,
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
    #: The run's gradient bounds (runs that commit gradients), else None.
    bounds: dict[str, float] | None = None

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
            "bounds": self.bounds,
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
    transition: Transition | Step,
    through: int | None = None,
) -> ReplayVerdict:
    """Replay from the snapshot preceding ``step`` through ``through`` (default ``step``).

    Args:
        proof_dir: the proof directory (or an already loaded :class:`Transcript`).
        step: the challenged step.
        transition: the attested program, as a state transition (a plain function of
            the whole step is accepted for runs that do not commit gradients).
        through: replay further, up to this step, to check a whole window.

    Returns:
        A verdict with per-step evidence; never raises for bad evidence.
    """
    verdict = ReplayVerdict(ok=False, step=step)
    if not isinstance(transition, Transition):
        transition = Transition(transition)
    try:
        transcript = proof_dir if isinstance(proof_dir, Transcript) else Transcript.load(proof_dir)
        verdict.tolerance = transcript.config.tolerance.to_dict()
        if transcript.grad is not None:
            verdict.bounds = transcript.bounds.to_dict()
            if transition.compute is None or transition.apply is None:
                raise ReplayError(
                    "unsupported_program",
                    "the run commits its gradients but this prover cannot split its step "
                    "into the gradient program and the optimizer",
                )
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
        state = _load_snapshot(transcript, start)
        verdict.snapshot_ok = True
        for k in range(start, end + 1):
            batch = _checked_batch(transcript, k, verdict)
            if transcript.grad is None:
                state = _replay_whole(transcript, k, state, batch, transition, verdict)
            else:
                state = _replay_halves(transcript, k, state, batch, transition, verdict)
        verdict.ok = True
    except ReplayError as error:
        verdict.reason = error.reason
        verdict.message = error.message
    if verdict.snapshot_ok is None and verdict.reason == "snapshot_mismatch":
        verdict.snapshot_ok = False
    return verdict


State = tuple[Leaves, Leaves, Leaves]


def _checked_batch(transcript: Transcript, k: int, verdict: ReplayVerdict) -> np.ndarray:
    """Step ``k``'s batch file, checked against its committed batch root."""
    record = transcript.steps[k]
    file = batch_path(transcript.path, k)
    if not file.exists():
        raise ReplayError("missing_file", f"batch file {file.name} for step {k} was not provided")
    try:
        batch = np.array(read_batch(file))
    except ValueError as error:
        raise ReplayError("batch_mismatch", str(error)) from None
    window = int(transcript.root["config"]["rolling_window"])
    if commit_batch(batch, window).root != record["batch"]["root"]:
        verdict.evidence.append(StepEvidence(k, False, False, None, False))
        raise ReplayError(
            "batch_mismatch",
            f"batch file {file.name} does not hash to step {k}'s committed batch root",
        )
    return batch


def _replayed_probes(
    transcript: Transcript, pre: Leaves, post: Leaves, delta: Leaves
) -> np.ndarray:
    """The pre-update, post-update and delta probes of a replayed step, as committed."""
    return np.stack(
        [
            np.concatenate(
                [p.reshape(-1) for p in transcript.probes.project_all([a for _, a in leaves])]
            )
            for leaves in (pre, post, delta)
        ]
    )


_PROBE_NAMES = ("pre-update", "post-update", "delta", "gradient")


def _replay_whole(
    transcript: Transcript,
    k: int,
    state: State,
    batch: np.ndarray,
    transition: Transition,
    verdict: ReplayVerdict,
) -> State:
    """One step of a run without committed gradients: the whole step, then compare."""
    record = transcript.steps[k]
    tol = transcript.config.tolerance
    pre_params = state[0]
    params, opt_state, buffers, deltas = transition(*state, batch, record)
    chunk = transcript.config.chunk_bytes
    replayed_roots = tuple(
        commit_state(leaves, chunk).root for leaves in (params, opt_state, buffers)
    )
    exact = replayed_roots == _roots(record["post"])
    excess: float | None = None
    ok = exact
    committed = transcript.committed_probes(k)
    if committed is not None:
        replayed = _replayed_probes(transcript, pre_params, params, deltas)
        excess, row, column = _probe_excess(replayed, committed, tol)
        if not exact and excess > 0:
            verdict.evidence.append(StepEvidence(k, True, exact, excess, False))
            raise ReplayError(
                "replay_mismatch",
                f"step {k}: the replayed {_PROBE_NAMES[row]} probe differs from the committed one at "
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
    return params, opt_state, buffers


def _gradient_evidence(comparison: Comparison) -> dict[str, Any]:
    worst = comparison.worst
    return {
        "exact": comparison.exact,
        "margin": comparison.margin,
        "worst": None if worst is None or worst.exact else worst.to_dict(),
    }


def _replay_halves(
    transcript: Transcript,
    k: int,
    state: State,
    batch: np.ndarray,
    transition: Transition,
    verdict: ReplayVerdict,
) -> State:
    """One step of a run that commits its gradients (module docstring, point 3)."""
    assert transition.compute is not None and transition.apply is not None
    record = transcript.steps[k]
    bounds = transcript.bounds
    committed = transcript.committed_computed(k)
    recomputed = transition.compute(*state, batch, record)
    comparison = compare(recomputed, committed, bounds)
    gradient = _gradient_evidence(comparison)
    if not comparison.ok:
        verdict.evidence.append(StepEvidence(k, True, False, None, False, gradient))
        raise ReplayError(
            "replay_mismatch",
            f"step {k}: the recomputed values differ from the committed ones beyond the "
            f"run's gradient bounds (tensor {bounds.tensor:g}, total {bounds.total:g}, "
            f"scale {bounds.scale:g}): {comparison.describe()}",
        )
    pre_params = state[0]
    params, opt_state, buffers, deltas = transition.apply(*state, committed, record)
    chunk = transcript.config.chunk_bytes
    replayed_roots = tuple(
        commit_state(leaves, chunk).root for leaves in (params, opt_state, buffers)
    )
    roots_exact = replayed_roots == _roots(record["post"])
    if not roots_exact and transition.canonical:
        verdict.evidence.append(StepEvidence(k, True, False, None, False, gradient))
        raise ReplayError(
            "replay_mismatch",
            f"step {k}: the optimizer applied to the committed gradient does not give the "
            "committed post-update state (the update is canonical: the same bits on any "
            "hardware); the state was changed otherwise than by this step's update",
        )
    probes = transcript.committed_probes(k)
    excess: float | None = None
    if probes is not None:
        replayed = _replayed_probes(transcript, pre_params, params, deltas)
        gradients = dict(committed)
        grad_rows = np.concatenate(
            [
                p.reshape(-1)
                for p in transcript.probes.project_all(
                    [
                        gradients.get(f"params:{name}", np.zeros(spec.shape, np.float32))
                        for (name, _), spec in zip(pre_params, transcript.params, strict=True)
                    ]
                )
            ]
        )
        replayed = np.vstack([replayed, grad_rows[None, :]])
        if roots_exact or transition.canonical:
            # The same state and gradient give the same probes, bit for bit, anywhere.
            differs = replayed.view(np.uint32) != probes.view(np.uint32)
            if differs.any():
                row, column = (int(i) for i in np.argwhere(differs)[0])
                verdict.evidence.append(StepEvidence(k, True, False, None, False, gradient))
                raise ReplayError(
                    "replay_mismatch",
                    f"step {k}: the committed {_PROBE_NAMES[row]} probe at coordinate {column} "
                    "is not the probe of the committed state and gradient",
                )
            excess = 0.0
        else:
            tol = transcript.config.tolerance
            excess, row, column = _probe_excess(replayed[:3], probes[:3], tol)
    if not roots_exact and (excess is None or excess > 0):
        tol = transcript.config.tolerance
        verdict.evidence.append(StepEvidence(k, True, False, excess, False, gradient))
        raise ReplayError(
            "replay_mismatch",
            f"step {k}: the optimizer applied to the committed gradient gives another "
            "post-update state, beyond tolerance in its probes "
            f"(abs {tol.absolute:g}, rel {tol.relative:g})"
            if excess is not None
            else f"step {k}: the optimizer applied to the committed gradient gives another "
            "post-update state and the run has no probes to compare within tolerance",
        )
    verdict.evidence.append(
        StepEvidence(k, True, roots_exact and comparison.exact, excess, True, gradient)
    )
    return params, opt_state, buffers


def windows(transcript: Transcript) -> list[tuple[int, int]]:
    """``(first, last)`` steps of every snapshot window of the run."""
    starts = sorted(transcript.snapshots)
    last = max(transcript.steps) if transcript.steps else -1
    ends = [s - 1 for s in starts[1:]] + [last]
    return [(a, b) for a, b in zip(starts, ends, strict=True) if a <= b]
