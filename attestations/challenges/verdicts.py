"""A proof's verdict from its challenges, and the deadlines that expire them.

:func:`settle` gives the proof its verdict once every challenge is final: ``valid`` iff
all passed, else ``rejected`` with the first failing challenge's reason and step; the seed
is revealed, and recording the verdict queues the certificate (``verdict_recorded``).
Unanswered challenges expire at the deadline (:func:`expire`), which rejects the proof.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from attestations.challenges.answers import enqueue
from attestations.challenges.models import (
    CHALLENGE_FINAL,
    Challenge,
    ChallengeStatus,
)
from attestations.challenges.policy import replay_time_limit
from attestations.challenges.routing import expire_unserved
from attestations.challenges.workspace import release_directory
from attestations.proofs.models import (
    Job,
    JobStatus,
    Proof,
    ProofStatus,
)
from provers.drift import REASON as DRIFT_REASON
from provers.drift import combine

log = logging.getLogger(__name__)


def progress(proof_id: int) -> None:
    """Record on the proof's replay job how many challenged steps are final."""
    job = Job.objects.filter(proof_id=proof_id, kind="replay").order_by("-created").first()
    if job is None:
        return
    rows = list(Challenge.objects.filter(proof_id=proof_id).values("status", "steps_total"))
    done = sum(r["steps_total"] for r in rows if r["status"] in CHALLENGE_FINAL)
    total = sum(r["steps_total"] for r in rows) or 1
    fields: dict[str, Any] = {"steps_done": done, "progress": min(1.0, done / total)}
    if job.status == JobStatus.QUEUED:
        fields.update(status=JobStatus.RUNNING, started=timezone.now())
    Job.objects.filter(pk=job.pk).update(**fields)


def settle(proof_id: int) -> str | None:
    """Give the proof its verdict once every challenge is final; None while some are not.

    ``valid`` iff every challenge passed (or was not replayed for want of a worker of
    the run's platform kind, which the message then says: no replay verdict, and the
    certificate claims nothing by replay for it); otherwise ``rejected`` with the first
    failing challenge's reason (by step). Reveals the seed; recording the verdict queues
    the certificate (``verdict_recorded``). Runs inside the caller's transaction and
    locks the proof row, so two workers finishing the last two challenges settle it once.
    """
    proof = (
        Proof.objects.select_for_update()
        .select_related("experiment__owner", "transcript")
        .get(pk=proof_id)
    )
    if proof.status != ProofStatus.CHALLENGED:
        return None
    challenges = list(proof.challenges.order_by("step", "through"))
    if any(c.status not in CHALLENGE_FINAL for c in challenges):
        return None
    # An unreplayed challenge (no worker of the run's platform kind) has no verdict: it
    # neither passes nor fails the proof, and the certificate says it was not replayed.
    failed = next(
        (
            c
            for c in challenges
            if c.status not in (ChallengeStatus.PASSED, ChallengeStatus.UNREPLAYED)
        ),
        None,
    )
    unreplayed = [c.step for c in challenges if c.status == ChallengeStatus.UNREPLAYED]
    now = timezone.now()
    proof.challenge_seed_revealed = now
    drift = run_drift(challenges)
    if failed is None and drift["exceeded"]:
        proof.record_verdict(
            ProofStatus.REJECTED,
            DRIFT_REASON,
            f"the committed-minus-recomputed differences of the challenged windows "
            f"(from steps {', '.join(map(str, drift['windows']))}) point the same way across "
            f"the run: combined alignment z = {drift['z']:.4g}, sign-flip p <= "
            f"{drift['p']:.3g} <= {drift['run_p']:g} "
            "(each window passed alone; rounding on other hardware does not add up across "
            "windows, a push inside the bounds does)",
            field="challenges",
        )
    elif failed is None:
        proof.record_verdict(
            ProofStatus.VALID,
            "",
            f"{len(unreplayed)} of {len(challenges)} challenges were not replayed: "
            f"{next(c.message for c in challenges if c.status == ChallengeStatus.UNREPLAYED)}"
            if unreplayed
            else "",
        )
    else:
        reason = failed.reason or failed.status
        proof.record_verdict(
            ProofStatus.REJECTED,
            reason,
            f"challenge of step {failed.step}: {failed.message or failed.get_status_display()}",
            field=f"challenges.step[{failed.step}]",
        )
    job = Job.objects.filter(proof_id=proof.pk, kind="replay").order_by("-created").first()
    if job is not None:
        job.finish(
            JobStatus.SUCCEEDED if failed is None or failed.status != "error" else JobStatus.FAILED,
            proof.reason,
        )
    transaction.on_commit(lambda: release_directory(proof))
    return proof.status


def run_drift(challenges: list[Challenge]) -> dict[str, Any]:
    """The drift test over every passed challenge's window (:func:`provers.drift.combine`):
    what the run's verdict and its certificate state."""
    windows = [
        c.evidence["drift"]
        for c in challenges
        if c.status == ChallengeStatus.PASSED
        and isinstance(c.evidence, dict)
        and isinstance(c.evidence.get("drift"), dict)
    ]
    return combine(windows)


def requeue_lost(now: Any = None) -> int:
    """Queue again challenges whose message was lost (a broker flushed, a worker died).

    A ``ready`` challenge not claimed, or a ``replaying`` claim not finished, within
    twice the task time limit has no live message behind it; a second message is
    harmless, since only one delivery can claim the challenge. One that waited that long
    because no worker of its run's platform kind is alive is recorded ``unreplayed``
    instead (:func:`~attestations.challenges.routing.expire_unserved`).
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=2 * replay_time_limit())
    lost = list(
        Challenge.objects.filter(
            Q(status=ChallengeStatus.READY, answered__lt=cutoff)
            | Q(status=ChallengeStatus.REPLAYING, claimed__lt=cutoff)
        ).values_list("pk", flat=True)
    )
    if lost:
        # Those whose run's platform kind still has no worker get no replay verdict.
        enqueue(expire_unserved(lost))
    return len(lost)


def expire(now: Any = None) -> int:
    """Expire the challenges of proofs past their deadline; returns how many expired.

    Also re-queues challenges whose replay message was lost (:func:`requeue_lost`).
    """
    now = now or timezone.now()
    requeue_lost(now)
    count = 0
    overdue = Proof.objects.filter(status=ProofStatus.CHALLENGED, challenge_deadline__lt=now)
    for proof_id in overdue.values_list("pk", flat=True):
        count += expire_proof(proof_id, now)
    return count


def expire_proof(proof_id: int, now: Any = None) -> int:
    """Expire one proof's unanswered challenges if its deadline passed (check on read)."""
    now = now or timezone.now()
    with transaction.atomic():
        expired = Challenge.objects.filter(
            proof_id=proof_id,
            proof__challenge_deadline__lt=now,
            proof__status=ProofStatus.CHALLENGED,
            status=ChallengeStatus.PENDING,
        ).update(
            status=ChallengeStatus.EXPIRED,
            reason="challenge_expired",
            message="the files this challenge needs were not provided before the deadline",
            finished=now,
        )
        if expired:
            progress(proof_id)
            settle(proof_id)
    return expired


def expire_if_due(proof: Proof) -> bool:
    """The check on read: a proof shown after its deadline shows its expired verdict.

    Returns:
        Whether anything expired (the caller re-reads the proof).
    """
    if (
        proof.status == ProofStatus.CHALLENGED
        and proof.challenge_deadline is not None
        and proof.challenge_deadline < timezone.now()
    ):
        return expire_proof(proof.pk) > 0
    return False
