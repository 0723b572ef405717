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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from provers.drift import REASON as DRIFT_REASON
from provers.drift import Drift
from zkdv.config import FloatTolerance
from zkdv.gradients import Comparison, compare
from zkdv.merkle import commit_state
from zkdv.replay import Leaves, ReplayError, Step, Transcript, Transition, roots

__all__ = [
    "Leaves",
    "ReplayError",
    "ReplayVerdict",
    "StepEvidence",
    "Transcript",
    "Transition",
    "replay",
]

ROOT_KEYS = ("p", "o", "b")
#: How a replayed step's post-update state was judged (``StepEvidence.state``).
_STATE_EXACT, _STATE_TOLERANCE = "exact", "tolerance"


@dataclass(frozen=True)
class StepEvidence:
    """What the replay found at one step.

    ``exact``: the step was reproduced bit for bit (its post-update state roots and, for
    a run that commits gradients, its recomputed gradient). ``gradient``: for such a
    run, how the recomputed values compared with the committed ones (the worst leaf's
    divergence and bound, and ``margin``: divergence over bound, 0 when bitwise equal,
    above 1 beyond the bound). ``state``: how the post-update state was judged:
    ``exact`` (its roots reproduced), ``tolerance`` (only its probes, within the run's
    tolerance: a step that commits no gradient, or whose update is not canonical,
    replayed where the bits differ); None where the step failed before.
    """

    step: int
    batch_ok: bool
    exact: bool
    probe_excess: float | None  # worst |diff| - bound over the probes; <= 0 is within tolerance
    ok: bool
    gradient: dict[str, Any] | None = None
    state: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch_ok": self.batch_ok,
            "exact": self.exact,
            "probe_excess": self.probe_excess,
            "ok": self.ok,
            "gradient": self.gradient,
            "state": self.state,
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
    #: Where the replay ran (the framework prover's description of the worker: its
    #: framework version, device kind, kernel family, threads), for the certificate.
    environment: dict[str, Any] | None = None
    #: How the replay was judged: ``exact`` where it ran in the run's own replay
    #: environment (every step must reproduce the committed bits), ``within_bounds``
    #: where the environment differs (the gradient within the run's bounds, the state
    #: still bit for bit); None before a prover judged it.
    judgement: str | None = None
    #: The replay-environment keys in which the worker differs from the run
    #: (:func:`zkdv.environments.differences`); empty when judged ``exact``.
    differences: list[str] = field(default_factory=list)
    #: The drift test over the replayed steps (:mod:`provers.drift`: the alignment S,
    #: its variance V, z and the threshold) for a run that commits its gradients; None
    #: for other runs.
    drift: dict[str, Any] | None = None

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
            "environment": self.environment,
            "judgement": self.judgement,
            "differences": list(self.differences),
            "drift": self.drift,
        }


def _probe_excess(
    replayed: np.ndarray, committed: np.ndarray, tolerance: FloatTolerance
) -> tuple[float, int, int]:
    bound = tolerance.absolute + tolerance.relative * np.abs(committed.astype(np.float64))
    excess = np.abs(replayed.astype(np.float64) - committed.astype(np.float64)) - bound
    excess = np.where(np.isnan(excess), np.inf, excess)
    flat = int(np.argmax(excess))
    row, column = divmod(flat, excess.shape[1])
    return float(excess.reshape(-1)[flat]), row, column


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
    drift: Drift | None = None
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
        _check_tokens(transcript, transition)
        _check_flops(transcript, transition)
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
        state = transcript.snapshot(start)
        verdict.snapshot_ok = True
        drift = Drift(first=start) if transcript.grad is not None else None
        for k in range(start, end + 1):
            batch = _checked_batch(transcript, k, verdict)
            if drift is None:
                state = _replay_whole(transcript, k, state, batch, transition, verdict)
            else:
                state = _replay_halves(transcript, k, state, batch, transition, verdict, drift)
        verdict.ok = True
    except ReplayError as error:
        verdict.reason = error.reason
        verdict.message = error.message
    if verdict.snapshot_ok is None and verdict.reason == "snapshot_mismatch":
        verdict.snapshot_ok = False
    if drift is not None and drift.inexact:
        drift.last = verdict.evidence[-1].step
        verdict.drift = drift.to_dict()
    return verdict


State = tuple[Leaves, Leaves, Leaves]


def _check_tokens(transcript: Transcript, transition: Transition) -> None:
    """Every step record's ``tokens`` is what the program's batch holds.

    The count a certificate's compute claims sum is the trainer's to write; the program
    the platform replays fixes the batch's shapes, so a count under- or over-reported on
    any step, challenged or not, is caught at the first replay.
    """
    if transition.tokens is None:
        return
    unit = transcript.config.token_unit
    for k in sorted(transcript.steps):
        claimed = transcript.steps[k].get("tokens")
        if claimed != transition.tokens:
            raise ReplayError(
                "tokens_mismatch",
                f"step {k}: the record claims {claimed} tokens (unit {unit!r}) but the "
                f"committed program trains {transition.tokens} per step (the shapes of its "
                "batch)",
            )


#: How far a step record's ``flops`` may be from the recount: the platform's Torch may
#: count an operator a little differently from the lab's (its FLOP formulas change
#: between releases), and a claim off by more than this is a forgery's, not a version's.
FLOPS_TOLERANCE = 0.01


def _check_flops(transcript: Transcript, transition: Transition) -> None:
    """Every step record's ``flops`` is, within 1 %, the committed program's recount.

    The FLOPs a certificate sums are the trainer's to write; the platform recounts them
    from the program it replays (``Transition.flops``), so a count under- or over-stated
    by more than :data:`FLOPS_TOLERANCE` on any step, challenged or not, is caught at the
    first replay. Where the program can be counted, a record without a count is a
    mismatch too (the certificate would replace it with a smaller estimate).
    """
    expected = transition.flops
    if expected is None or expected <= 0:
        return
    for k in sorted(transcript.steps):
        claimed = transcript.steps[k].get("flops")
        if (
            claimed is None
            or isinstance(claimed, bool)
            or not isinstance(claimed, int | float)
            or not abs(float(claimed) - expected) <= FLOPS_TOLERANCE * expected
        ):
            raise ReplayError(
                "flops_mismatch",
                f"step {k}: the record claims {claimed!r} FLOPs but the committed program "
                f"counts {expected:.6g} per step (off by more than "
                f"{FLOPS_TOLERANCE:.0%})",
            )


def _checked_batch(transcript: Transcript, k: int, verdict: ReplayVerdict) -> np.ndarray:
    """Step ``k``'s batch file, checked against its committed batch root."""
    try:
        return transcript.batch(k)
    except ReplayError as error:
        if error.reason == "batch_mismatch":
            verdict.evidence.append(StepEvidence(k, False, False, None, False))
        raise


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
    exact = replayed_roots == roots(record["post"])
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
    judged = _STATE_EXACT if exact else _STATE_TOLERANCE
    verdict.evidence.append(StepEvidence(k, True, exact, excess, ok, None, judged))
    return params, opt_state, buffers


_ROOT_NAMES = {"p": "parameters", "o": "optimizer state", "b": "buffers"}


def _differing(
    transcript: Transcript, k: int, replayed_roots: tuple[bytes, ...], params: Leaves
) -> str:
    """Which fields of step ``k``'s record the replayed post-update state differs in.

    The committed roots (``post.p``, ``post.o``, ``post.b``) that differ, and for the
    parameters the first whose committed post-update probes are not the replayed ones'.
    """
    committed = roots(transcript.steps[k]["post"])
    fields = [
        f"post.{key} ({_ROOT_NAMES[key]})"
        for key, mine, theirs in zip(ROOT_KEYS, replayed_roots, committed, strict=True)
        if mine != theirs
    ]
    probes = transcript.committed_probes(k)
    if probes is not None and replayed_roots[0] != committed[0]:
        offset = 0
        projected = transcript.probes.project_all([a for _, a in params])
        for (name, _), row in zip(params, projected, strict=True):
            mine = np.asarray(row, np.float32).reshape(-1)
            theirs = probes[1, offset : offset + mine.size].astype(np.float32)
            offset += mine.size
            if (mine.view(np.uint32) != theirs.view(np.uint32)).any():
                fields.append(f"first at parameter {name}")
                break
    return "differs in " + ", ".join(fields) if fields else "no committed root differs"


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
    drift: Drift,
) -> State:
    """One step of a run that commits its gradients (module docstring, point 3)."""
    assert transition.compute is not None and transition.apply is not None
    record = transcript.steps[k]
    recomputed = transition.compute(*state, batch, record)
    if transcript.keeps_gradient_files:
        committed = transcript.committed_computed(k)
        comparison, gradient = _compared_gradient(transcript, k, recomputed, committed, verdict)
        exact_gradient = comparison.exact
        if not exact_gradient:
            _check_drift(drift, k, recomputed, committed, verdict, gradient)
    else:
        committed, gradient = _recomputed_as_committed(transcript, k, recomputed, verdict)
        exact_gradient = True
    pre_params = state[0]
    params, opt_state, buffers, deltas = transition.apply(*state, committed, record)
    chunk = transcript.config.chunk_bytes
    replayed_roots = tuple(
        commit_state(leaves, chunk).root for leaves in (params, opt_state, buffers)
    )
    roots_exact = replayed_roots == roots(record["post"])
    if not roots_exact and transition.canonical:
        verdict.evidence.append(StepEvidence(k, True, False, None, False, gradient))
        raise ReplayError(
            "replay_mismatch",
            f"step {k}: the optimizer applied to the committed gradient does not give the "
            f"committed post-update state ({_differing(transcript, k, replayed_roots, params)}; "
            "the update is canonical: the same bits on any hardware); the state was changed "
            "otherwise than by this step's update",
        )
    excess = _update_probe_excess(
        transcript,
        k,
        (pre_params, params, deltas),
        committed,
        bitwise=roots_exact or transition.canonical,
        verdict=verdict,
        gradient=gradient,
    )
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
    judged = _STATE_EXACT if roots_exact else _STATE_TOLERANCE
    verdict.evidence.append(
        StepEvidence(k, True, roots_exact and exact_gradient, excess, True, gradient, judged)
    )
    return params, opt_state, buffers


def _recomputed_as_committed(
    transcript: Transcript, k: int, recomputed: Leaves, verdict: ReplayVerdict
) -> tuple[Leaves, dict[str, Any]]:
    """A run that kept no gradient files (``config.gradient_files`` ``"never"``): the
    recomputed values must hash to the step's committed ``grad`` root, bit for bit."""
    root = commit_state(recomputed, transcript.config.chunk_bytes).root
    if root != transcript.steps[k]["grad"]:
        evidence = {"exact": False, "margin": None, "worst": None}
        verdict.evidence.append(StepEvidence(k, True, False, None, False, evidence))
        raise ReplayError(
            "gradient_mismatch",
            f"step {k}: the recomputed values do not hash to the committed grad root, and "
            "the run kept no gradient files to compare them within bounds "
            "(config.gradient_files 'never'): in the training's own kernel environment, "
            "the committed gradient is not the one this step computes",
        )
    return recomputed, {"exact": True, "margin": 0.0, "worst": None}


def _compared_gradient(
    transcript: Transcript, k: int, recomputed: Leaves, committed: Leaves, verdict: ReplayVerdict
) -> tuple[Comparison, dict[str, Any]]:
    """The recomputed values against the committed ones, within the run's gradient bounds."""
    bounds = transcript.bounds
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
    return comparison, gradient


def _check_drift(
    drift: Drift,
    k: int,
    recomputed: Leaves,
    committed: Leaves,
    verdict: ReplayVerdict,
    gradient: dict[str, Any],
) -> None:
    """Add step ``k``'s differences to the window's drift test (:mod:`provers.drift`);
    fail the step where the window's differences stop looking like rounding."""
    drift.add(k, recomputed, committed)
    gradient["drift_z"] = drift.z
    if drift.exceeded:
        verdict.evidence.append(StepEvidence(k, True, False, None, False, gradient))
        raise ReplayError(DRIFT_REASON, f"step {k}: {drift.describe()}")


def _update_probe_excess(
    transcript: Transcript,
    k: int,
    replayed_leaves: tuple[Leaves, Leaves, Leaves],
    committed: Leaves,
    *,
    bitwise: bool,
    verdict: ReplayVerdict,
    gradient: dict[str, Any],
) -> float | None:
    """How far the replayed update's probes lie beyond tolerance; None without probes.

    ``replayed_leaves`` are the pre-update parameters, the post-update parameters and the
    deltas. With ``bitwise`` (the replayed state hashed to the committed roots, or the
    update is canonical) the probes must match bit for bit: 0.0, or a ``replay_mismatch``.
    """
    probes = transcript.committed_probes(k)
    if probes is None:
        return None
    pre_params, params, deltas = replayed_leaves
    replayed = _replayed_probes(transcript, pre_params, params, deltas)
    replayed = np.vstack([replayed, _gradient_probes(transcript, pre_params, committed)[None, :]])
    if not bitwise:
        excess, _, _ = _probe_excess(replayed[:3], probes[:3], transcript.config.tolerance)
        return excess
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
    return 0.0


def _gradient_probes(transcript: Transcript, pre_params: Leaves, committed: Leaves) -> np.ndarray:
    """The probes of the committed gradient (zeros for a parameter it has none of)."""
    gradients = dict(committed)
    return np.concatenate(
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


def windows(transcript: Transcript) -> list[tuple[int, int]]:
    """``(first, last)`` steps of every snapshot window of the run."""
    starts = sorted(transcript.snapshots)
    last = max(transcript.steps) if transcript.steps else -1
    ends = [s - 1 for s in starts[1:]] + [last]
    return [(a, b) for a, b in zip(starts, ends, strict=True) if a <= b]
