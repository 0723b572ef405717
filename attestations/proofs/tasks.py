"""Celery tasks of proofs: ingest a filed transcript, and send ingest again when lost.

Thin wrappers that pass ids, claim, then delegate to the ingest service
(:mod:`attestations.proofs.ingest`). Each task is named after this module
(``attestations.proofs.tasks.<function>``), the name the beat schedule uses.
"""

from __future__ import annotations

import contextlib
import logging

from celery import Task, shared_task
from django.conf import settings

from attestations.core.transient import TRANSIENT_ERRORS
from attestations.proofs.ingest import ingest
from attestations.proofs.models import Proof, ProofStatus

log = logging.getLogger(__name__)


@shared_task(
    bind=True,
    name="attestations.proofs.tasks.ingest_proof",
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
        ingest(proof)
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


@shared_task(name="attestations.proofs.tasks.requeue_stale_ingests", acks_late=True)
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
