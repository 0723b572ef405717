"""The workers' own task: the heartbeat.

Task names keep the ``attestations.tasks.`` prefix they had before the apps were split:
they are the names in queued messages and in the beat schedule (``config/settings.py``).
"""

from __future__ import annotations

import socket

from celery import shared_task

from attestations.workers.models import WorkerHeartbeat


@shared_task(name="attestations.tasks.heartbeat", acks_late=True, reject_on_worker_lost=True)
def heartbeat(token: str) -> str:
    """Record that a worker ran; idempotent on ``token`` so a redelivery is harmless."""
    row, _ = WorkerHeartbeat.objects.get_or_create(
        token=token, defaults={"hostname": socket.gethostname()}
    )
    return row.hostname
