"""Celery tasks: thin wrappers that pass ids, claim, then delegate to models or services."""

from __future__ import annotations

import socket

from celery import shared_task

from attestations.models import WorkerHeartbeat


@shared_task(name="attestations.tasks.heartbeat", acks_late=True, reject_on_worker_lost=True)
def heartbeat(token: str) -> str:
    """Record that a worker ran; idempotent on ``token`` so a redelivery is harmless."""
    row, _ = WorkerHeartbeat.objects.get_or_create(
        token=token, defaults={"hostname": socket.gethostname()}
    )
    return row.hostname
