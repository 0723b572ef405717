"""Celery tasks that issue certificates and checkpoint the transparency log."""

from __future__ import annotations

from celery import shared_task


@shared_task(
    name="attestations.certificate_tasks.issue_certificate",
    acks_late=True,
    reject_on_worker_lost=True,
)
def issue_certificate(proof_id: int) -> str | None:
    """Sign the certificate of a proof whose verdict is final (being built in issue 9)."""
    return None
