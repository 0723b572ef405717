"""Replaying one challenge: claim it, run the prover, record its verdict or its error.

The ``replay_challenge`` task (:mod:`attestations.challenges.tasks`) claims a challenge
(:func:`claim`), runs :func:`replay_one` (:func:`provers.verify_challenge` over the proof
directory, in a sandboxed child process) and records the outcome (:func:`record_verdict`, :func:`record_error`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

import provers
from attestations.audit.models import AuditEvent
from attestations.challenges import sandboxed
from attestations.challenges.index import PROBES
from attestations.challenges.models import (
    Challenge,
    ChallengeStatus,
)
from attestations.challenges.routing import misrouted
from attestations.challenges.verdicts import progress, settle
from attestations.challenges.workspace import proof_directory
from attestations.core.db import take_claim
from attestations.proofs.models import (
    Proof,
)

log = logging.getLogger(__name__)


def claim(challenge_id: int) -> bool:
    """Take a ready challenge (or one whose replaying worker died) for this worker.

    A conditional update (:func:`~attestations.core.db.take_claim`): of two deliveries of
    the same message, one wins. Each claim counts an attempt.
    """
    return take_claim(
        Challenge.objects.filter(pk=challenge_id),
        waiting=ChallengeStatus.READY,
        working=ChallengeStatus.REPLAYING,
        attempts=F("attempts") + 1,
    )


#: Probe files already checked against their transcript, by ``(transcript, probes)``
#: SHA-256: the first replay of a proof checks the whole file, later ones reuse that.
_PROBES_CHECKED: OrderedDict[tuple[str, str], dict[str, Any] | None] = OrderedDict()
_PROBES_KEPT = 16
_PROBES_LOCK = threading.Lock()


def check_probes(proof: Proof, directory: Path) -> dict[str, Any] | None:
    """Check the attached ``probes.bin`` against every probe digest of the transcript.

    The trainer attaches the probe file after ingest, so the offline verifier could not
    check it then; the first replay does, before trusting any probe it compares. Runs
    the offline verifier over the proof directory (records and probes side by side).

    Returns:
        None when there is no probe file or it matches; else a failed verdict's dict
        naming the verifier's reason (``probe_digest``, ``probe_missing``, ...), the
        record and the field.
    """
    from zkdv.verify import verify_transcript

    path = directory / PROBES
    artifact = proof.artifacts.filter(name=PROBES).select_related("blob").first()
    if artifact is None or not path.exists():
        return None
    key = (proof.transcript.sha256, artifact.sha256)
    with _PROBES_LOCK:
        if key in _PROBES_CHECKED:
            return _PROBES_CHECKED[key]
    report = verify_transcript(directory)
    failure: dict[str, Any] | None = None
    if not report.ok:
        failure = {
            "ok": False,
            "step": None,
            "reason": report.reason or "probe_mismatch",
            "message": f"{PROBES}: {report.message}",
            "record": report.record,
            "field": report.field,
            "evidence": [],
        }
    with _PROBES_LOCK:
        _PROBES_CHECKED[key] = failure
        while len(_PROBES_CHECKED) > _PROBES_KEPT:
            _PROBES_CHECKED.popitem(last=False)
    return failure


def replay_one(challenge: Challenge) -> dict[str, Any]:
    """Materialise and replay one claimed challenge; returns the verdict's dict, or
    ``{UNREPLAYED: why}`` when this worker is of another platform kind than the run
    (:func:`~attestations.challenges.routing.misrouted`).

    The replay runs in a sandboxed child process (:func:`sandboxed.replay`), never in
    this one: it runs the lab's program. The probe file is checked here first, by the
    platform's own transcript verifier.
    """
    proof = challenge.proof
    directory = proof_directory(proof, challenge.needed_files)
    failure = check_probes(proof, directory)
    if failure is not None:
        return {**failure, "step": challenge.step}
    # A worker of another platform kind than the run's replays nothing (routing.py).
    wrong_kind = misrouted(proof, worker_environment(proof))
    if wrong_kind is not None:
        return {UNREPLAYED: wrong_kind}
    return sandboxed.replay(directory, challenge.needed_files, challenge.step, challenge.through)


def worker_environment(proof: Proof) -> dict[str, Any]:
    """Where this worker would replay ``proof`` (its prover's ``environment()``): this
    host's framework and hardware, read in a child without loading anything of the lab's
    (:func:`sandboxed.replay_environment`)."""
    root = (proof.report or {}).get("root")
    prover = root.get("prover") if isinstance(root, Mapping) else None
    return sandboxed.replay_environment(provers.PROVERS.get(str(prover), "provers.jax_replay"))


#: The key of :func:`replay_one`'s answer for a challenge this worker must not replay.
UNREPLAYED = "unreplayed"


def record_verdict(challenge: Challenge, verdict: Mapping[str, Any]) -> bool:
    """Store a replay verdict; False if the challenge was no longer ours to finish."""
    evidence = list(verdict.get("evidence") or [])
    replayed = sum(1 for e in evidence if e.get("ok"))
    ok = bool(verdict.get("ok"))
    with transaction.atomic():
        done = Challenge.objects.filter(pk=challenge.pk, status=ChallengeStatus.REPLAYING).update(
            status=ChallengeStatus.PASSED if ok else ChallengeStatus.FAILED,
            reason="" if ok else str(verdict.get("reason") or "replay_failed")[:64],
            message="" if ok else str(verdict.get("message") or ""),
            evidence=dict(verdict),
            steps_replayed=len(evidence) if ok else replayed,
            finished=timezone.now(),
        )
        if not done:
            return False
        AuditEvent.record(
            f"challenge.{'passed' if ok else 'failed'}",
            organization=challenge.proof.experiment.owner,
            target=challenge,
            detail={
                "proof": challenge.proof_id,
                "step": challenge.step,
                "through": challenge.through,
                "reason": None if ok else verdict.get("reason"),
                "attempts": challenge.attempts,
            },
        )
        progress(challenge.proof_id)
        settle(challenge.proof_id)
    return True


def record_error(challenge_id: int, reason: str, message: str) -> None:
    """A permanent failure that is not the proof's fault (the replay itself broke)."""
    with transaction.atomic():
        done = Challenge.objects.filter(
            pk=challenge_id, status__in=[ChallengeStatus.REPLAYING, ChallengeStatus.READY]
        ).update(
            status=ChallengeStatus.ERROR,
            reason=reason[:64],
            message=message,
            finished=timezone.now(),
        )
        if done:
            proof_id = Challenge.objects.values_list("proof_id", flat=True).get(pk=challenge_id)
            progress(proof_id)
            settle(proof_id)


def release_claim(challenge_id: int) -> None:
    """Give a claimed challenge back (a transient failure: the retry claims it again)."""
    Challenge.objects.filter(pk=challenge_id, status=ChallengeStatus.REPLAYING).update(
        status=ChallengeStatus.READY
    )
