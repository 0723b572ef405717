"""Server-side verifiers: the framework-free transcript verifier and the whitebox replay provers.

Pure functions with no Django: they take bytes and files and return verdicts.

:func:`verify_challenge` replays one challenged step (or a window, ``through=``) of a
stored proof directory with the prover its root record names: ``whitebox-jax``
(:mod:`provers.jax_replay`) or ``whitebox-torch`` (:mod:`provers.torch_replay`). The
framework of the other prover is never imported, so a worker needs only its own.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from zkdv.replay import program_material, root_record

if TYPE_CHECKING:
    from provers.replay import ReplayVerdict, Transition

__all__ = ["PROVERS", "program_material", "require_exact", "root_record", "verify_challenge"]

#: Prover name (the root record's ``prover``) to the module that replays it.
PROVERS = {"whitebox-jax": "provers.jax_replay", "whitebox-torch": "provers.torch_replay"}


def require_exact(verdict: ReplayVerdict) -> ReplayVerdict:
    """Fail a verdict whose steps matched only within tolerance (for exact replays)."""
    from provers.replay import StepEvidence

    if not verdict.ok:
        return verdict
    for index, evidence in enumerate(verdict.evidence):
        if not evidence.exact:
            verdict.ok = False
            verdict.reason = "replay_mismatch"
            verdict.message = (
                f"step {evidence.step}: the recomputed gradient is not the committed one bit "
                "for bit, although the same program ran in the recorded environment (it is "
                "within the gradient bounds, which a replay on other hardware would accept)"
                if evidence.gradient is not None
                else f"step {evidence.step}: the replayed state does not reproduce the "
                "committed state roots bit for bit, although the same program ran in the "
                "recorded environment (the probes agree within tolerance: the difference "
                "lies where they do not look)"
            )
            verdict.evidence[index] = StepEvidence(
                evidence.step,
                evidence.batch_ok,
                False,
                evidence.probe_excess,
                False,
                evidence.gradient,
            )
            del verdict.evidence[index + 1 :]
            break
    return verdict


def verify_challenge(
    proof_dir: str | os.PathLike[str],
    step: int,
    *,
    through: int | None = None,
    transition: Transition | None = None,
) -> ReplayVerdict:
    """Replay one challenge with the prover named by the proof's root record.

    Args:
        proof_dir: the proof directory (transcript, program artifact, files).
        step: the challenged step.
        through: replay on to this step (a whole window).
        transition: an already loaded transition of this proof, to skip the
            one-time artifact load when a worker checks several challenges.

    Returns:
        The verdict; a bad proof is a failed verdict with a reason, never an exception.
    """
    import importlib

    from provers.replay import ReplayVerdict
    from zkdv.replay import ReplayError

    try:
        prover = root_record(proof_dir).get("prover")
    except ReplayError as error:
        return ReplayVerdict(ok=False, step=step, reason=error.reason, message=error.message)
    name = PROVERS.get(str(prover))
    if name is None:
        return ReplayVerdict(
            ok=False,
            step=step,
            reason="unknown_prover",
            message=f"no replay prover for {prover!r}; known: {sorted(PROVERS)}",
        )
    module = importlib.import_module(name)
    verdict: ReplayVerdict = module.verify_challenge(
        proof_dir, step, through=through, transition=transition
    )
    return verdict
