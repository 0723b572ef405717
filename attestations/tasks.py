"""Celery tasks: thin wrappers that pass ids, claim, then delegate to models or services."""

from __future__ import annotations

import contextlib
import logging
import socket

from celery import Task, shared_task
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError

from attestations.models import Challenge, Proof, ProofStatus, WorkerHeartbeat

log = logging.getLogger(__name__)


#: Errors a retry may cure: the database, the broker or the disk were briefly unavailable.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseError,
    InterfaceError,
    OperationalError,
    KombuOperationalError,
    OSError,
)


@shared_task(name="attestations.tasks.heartbeat", acks_late=True, reject_on_worker_lost=True)
def heartbeat(token: str) -> str:
    """Record that a worker ran; idempotent on ``token`` so a redelivery is harmless."""
    row, _ = WorkerHeartbeat.objects.get_or_create(
        token=token, defaults={"hostname": socket.gethostname()}
    )
    return row.hostname


@shared_task(
    bind=True,
    name="attestations.tasks.ingest_proof",
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=30,
)
def ingest_proof(self: Task, proof_id: int) -> str | None:  # type: ignore[type-arg]
    """Verify a filed transcript and record the verdict.

    Idempotent: the proof is claimed with a conditional update (pending -> verifying), so
    a redelivered message, or a second worker, finds nothing to do and returns None. A
    claim held by a worker that may have died (killed mid-task: the broker redelivers the
    message at once) is looked at again once it is stale, so the proof is never left
    ``verifying``. Transient errors (database, broker, disk) retry with backoff.

    Returns:
        The proof's final status, or None when another worker owns it.
    """
    try:
        if not Proof.claim(proof_id):
            held = Proof.objects.filter(pk=proof_id, status=ProofStatus.VERIFYING).exists()
            if held and self.request.retries < (self.max_retries or 0):
                raise self.retry(countdown=int(settings.CELERY_TASK_TIME_LIMIT) + 1)
            return None
        proof = Proof.objects.select_related("experiment__owner", "transcript").get(pk=proof_id)
        proof.verify()
    except TRANSIENT_ERRORS as error:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            Proof.objects.filter(pk=proof_id, status=ProofStatus.VERIFYING).update(
                status=ProofStatus.PENDING
            )
        raise self.retry(
            exc=error,  # type: ignore[arg-type]
            countdown=min(60, 2 ** (self.request.retries + 1)),
        ) from error
    return proof.status


@shared_task(name="attestations.tasks.requeue_stale_ingests", acks_late=True)
def requeue_stale_ingests(older_than: float | None = None) -> int:
    """Send ingest again for proofs still pending after ``older_than`` seconds (periodic).

    A message can be lost where no retry reaches it: the broker was down when the web
    process queued it, or a worker was killed between taking it and recording it as
    unacknowledged. Ingest is idempotent, so a second message for a proof whose first is
    merely late costs one claim that fails. Returns how many were sent again.
    """
    from datetime import timedelta

    from django.utils import timezone

    age = settings.DVBENCH_INGEST_REQUEUE_SECONDS if older_than is None else older_than
    stale = Proof.objects.filter(
        status=ProofStatus.PENDING, created__lte=timezone.now() - timedelta(seconds=age)
    ).values_list("pk", flat=True)
    count = 0
    for proof_id in stale:
        ingest_proof.delay(proof_id)
        count += 1
    return count


@shared_task(
    bind=True,
    name="attestations.tasks.replay_challenge",
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=5,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def replay_challenge(self: Task, challenge_id: int) -> str | None:  # type: ignore[type-arg]
    """Replay one challenge and record its verdict (queue ``replay``).

    Keyed by the challenge: it is claimed with a conditional update (ready -> replaying,
    or a stale ``replaying`` claim whose worker died), so a redelivered message or a
    second worker finds nothing to do. Late acknowledgement with reject-on-worker-lost
    means a worker killed mid-replay leaves the message to the broker, which delivers it
    again once the claim is stale. Transient errors (database, broker, disk) release the
    claim and retry with exponential backoff; anything else, and the soft time limit,
    is recorded on the challenge as a permanent ``error`` with its reason.

    Returns:
        The challenge's final status, or None when another worker owns it.
    """
    from celery.exceptions import SoftTimeLimitExceeded

    from attestations import replay

    if not replay.claim(challenge_id):
        return None
    replay.pause_for_tests()
    try:
        challenge = Challenge.objects.select_related("proof__transcript", "proof__experiment").get(
            pk=challenge_id
        )
        verdict = replay.replay_one(challenge)
        replay.record_verdict(challenge, verdict)
    except replay.BlobCorruptError as error:
        replay.record_error(challenge_id, "blob_corrupt", str(error))
    except SoftTimeLimitExceeded:
        replay.record_error(
            challenge_id, "replay_timeout", "the replay ran past the task's soft time limit"
        )
    except TRANSIENT_ERRORS as error:
        replay.release_claim(challenge_id)
        if self.request.retries >= (self.max_retries or 0):
            replay.record_error(
                challenge_id, "replay_unavailable", f"{type(error).__name__}: {error}"
            )
            raise
        raise self.retry(
            exc=error,  # type: ignore[arg-type]
            countdown=min(300, 2 ** (self.request.retries + 1)),
        ) from error
    except Exception as error:
        log.exception("replaying challenge %s failed", challenge_id)
        replay.record_error(challenge_id, "replay_failed", f"{type(error).__name__}: {error}")
    return str(Challenge.objects.values_list("status", flat=True).get(pk=challenge_id))


@shared_task(name="attestations.tasks.expire_challenges", acks_late=True)
def expire_challenges() -> int:
    """Expire challenges left unanswered past their deadline (run periodically).

    Each expiry rejects its proof (``challenge_expired``). Idempotent: an expired
    challenge is final and is not touched again.
    """
    from attestations import replay

    return replay.expire()


# Certificate tasks live in their own module; importing it registers them with Celery.
from attestations.certificate_tasks import issue_certificate  # noqa: E402, F401
