"""Server-side verifiers: the framework-free transcript verifier and the whitebox replay provers.

Pure functions with no Django: they take bytes and files and return verdicts.

A :class:`Prover` is one proof's replay: it reads the proof's root record once, picks the
module of the prover the record names (``whitebox-jax``, :mod:`provers.jax_replay`, or
``whitebox-torch``, :mod:`provers.torch_replay`; the framework of the other prover is
never imported, so a worker needs only its own), loads the committed program on its
first challenge and keeps it for the next. :func:`open_prover` keeps the provers of the
last few proofs a worker replayed; :func:`verify_challenge` replays one challenged step
(or a window, ``through=``) with a prover of its own.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from zkdv.replay import ReplayError, program_material, root_record

if TYPE_CHECKING:
    from provers.replay import ReplayVerdict, Transition

__all__ = [
    "EXACT",
    "INEXACT_ENVIRONMENT",
    "PROVERS",
    "WITHIN_BOUNDS",
    "Prover",
    "close_provers",
    "judge",
    "open_prover",
    "program_material",
    "require_exact",
    "root_record",
    "verify_challenge",
]

#: Prover name (the root record's ``prover``) to the module that replays it.
PROVERS = {"whitebox-jax": "provers.jax_replay", "whitebox-torch": "provers.torch_replay"}


#: The reason of a verdict this worker could not give: the run kept no gradient files
#: and this worker's environment is not the run's (:func:`judge`). The platform records
#: such a challenge as not replayed, never as failed.
INEXACT_ENVIRONMENT = "inexact_environment"

#: A replay's judgement (``ReplayVerdict.judgement``): bit for bit in the run's own
#: replay environment, within the run's gradient bounds (or tolerance) elsewhere.
EXACT, WITHIN_BOUNDS = "exact", "within_bounds"


def judge(
    verdict: ReplayVerdict,
    differences: list[str],
    *,
    exact: bool,
    gradient_files: bool = True,
) -> ReplayVerdict:
    """Record how ``verdict`` is judged, and hold it to exactness where it must be.

    Args:
        verdict: the replay's verdict, as :func:`provers.replay.replay` returned it.
        differences: the replay-environment keys in which the worker differs from the run.
        exact: whether the replay must reproduce every step bit for bit (the prover's
            choice: the run's own environment, or a caller's ``exact=``).
        gradient_files: whether the run kept its gradient files
            (``Transcript.keeps_gradient_files``). A run that did not can be judged only
            bit for bit: outside its environment a gradient that differs is reported as
            ``inexact_environment``, a step this worker cannot judge, not as a forgery.
    """
    verdict.differences = list(differences)
    verdict.judgement = EXACT if exact else WITHIN_BOUNDS
    if not exact and not gradient_files and verdict.reason == "gradient_mismatch":
        verdict.reason = INEXACT_ENVIRONMENT
        verdict.message = (
            f"{verdict.message}. The run kept no gradient files, so only a replay in its "
            "own kernel environment can judge it; this worker differs in: "
            f"{', '.join(differences) or 'nothing recorded'}"
        )
    return require_exact(verdict) if exact else verdict


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
                evidence.state,
            )
            del verdict.evidence[index + 1 :]
            break
    return verdict


class Prover:
    """One proof's replay prover: its root record read once, its program loaded once.

    Open one with :meth:`open` (or :func:`open_prover`, which keeps it for the proof's
    next challenge); :meth:`verify` replays a challenge. The transcript itself is read
    again by every replay: the files a challenge needs arrive with it.
    """

    def __init__(self, directory: Path, root: dict[str, object], module: ModuleType) -> None:
        self.directory = directory
        self.root = root
        self.module = module
        self._transition: Transition | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, proof_dir: str | os.PathLike[str]) -> Prover:
        """The prover the proof's root record names.

        Raises:
            zkdv.replay.ReplayError: the root record cannot be read (``invalid_transcript``,
                ``missing_file``), or it names no prover this package has
                (``unknown_prover``).
        """
        root = root_record(proof_dir)
        prover = root.get("prover")
        name = PROVERS.get(str(prover))
        if name is None:
            raise ReplayError(
                "unknown_prover", f"no replay prover for {prover!r}; known: {sorted(PROVERS)}"
            )
        return cls(Path(proof_dir), root, importlib.import_module(name))

    def transition(self) -> Transition | None:
        """The committed program as a state transition, loaded on first use.

        None when it cannot be loaded: :meth:`verify` then loads it again and reports why.
        """
        with self._lock:
            if self._transition is None:
                try:
                    self._transition = self.module.load_transition(self.directory)
                except ReplayError:
                    return None
            return self._transition

    def verify(self, step: int, *, through: int | None = None) -> ReplayVerdict:
        """Replay the challenged ``step`` (through ``through``, a whole window)."""
        verdict: ReplayVerdict = self.module.verify_challenge(
            self.directory, step, through=through, transition=self.transition()
        )
        return verdict


#: The provers of the last proofs replayed in this process, by the caller's key (the
#: transcript's digest): a worker that checks several challenges of one proof loads its
#: program once. Two: a loaded program holds the model's compiled code.
_OPEN: OrderedDict[str, Prover] = OrderedDict()
_OPEN_KEPT = 2
_OPEN_LOCK = threading.Lock()


def open_prover(proof_dir: str | os.PathLike[str], key: str) -> Prover:
    """The prover of the proof stored under ``key``, opened once per process.

    Raises:
        zkdv.replay.ReplayError: as :meth:`Prover.open`.
    """
    with _OPEN_LOCK:
        prover = _OPEN.get(key)
        if prover is not None and prover.directory == Path(proof_dir):
            _OPEN.move_to_end(key)
            return prover
    prover = Prover.open(proof_dir)
    with _OPEN_LOCK:
        _OPEN[key] = prover
        while len(_OPEN) > _OPEN_KEPT:
            _OPEN.popitem(last=False)
    return prover


def close_provers() -> None:
    """Forget every open prover: the next challenge of any proof loads its program again
    (a worker starting cold, as ``bench/challenges_per_hour.py`` measures it)."""
    with _OPEN_LOCK:
        _OPEN.clear()


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
            one-time artifact load when a caller checks several challenges.

    Returns:
        The verdict; a bad proof is a failed verdict with a reason, never an exception.
    """
    from provers.replay import ReplayVerdict

    try:
        prover = Prover.open(proof_dir)
    except ReplayError as error:
        return ReplayVerdict(ok=False, step=step, reason=error.reason, message=error.message)
    if transition is not None:
        prover._transition = transition
    return prover.verify(step, through=through)
