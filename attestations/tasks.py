"""Celery tasks: thin wrappers that pass ids, claim, then delegate to models or services."""

from __future__ import annotations

import socket

from celery import shared_task

from attestations.models import Proof, WorkerHeartbeat


@shared_task(name="attestations.tasks.heartbeat", acks_late=True, reject_on_worker_lost=True)
def heartbeat(token: str) -> str:
    """Record that a worker ran; idempotent on ``token`` so a redelivery is harmless."""
    row, _ = WorkerHeartbeat.objects.get_or_create(
        token=token, defaults={"hostname": socket.gethostname()}
    )
    return row.hostname


@shared_task(name="attestations.tasks.ingest_proof", acks_late=True, reject_on_worker_lost=True)
def ingest_proof(proof_id: int) -> str | None:
    """Verify a filed transcript and record the verdict.

    Idempotent: the proof is claimed with a conditional update (pending -> verifying), so
    a redelivered message, or a second worker, finds nothing to do and returns None.

    Returns:
        The proof's final status, or None when another worker owns it.
    """
    if not Proof.claim(proof_id):
        return None
    proof = Proof.objects.select_related("experiment__owner", "transcript").get(pk=proof_id)
    proof.verify()
    return proof.status


@shared_task(name="attestations.tasks.expire_uploads", acks_late=True)
def expire_uploads() -> int:
    """Remove the staged parts of uploads left open past their expiry (run periodically).

    Idempotent: an upload already expired is no longer open and is not touched again.
    """
    from attestations import uploads

    return uploads.expire_stale()


# Certificate tasks live in their own module; importing it registers them with Celery.
from attestations.certificate_tasks import issue_certificate  # noqa: E402, F401
