"""The workers' own tasks: the heartbeat, and the replay workers' presence.

Each task is named after this module (``attestations.workers.tasks.<function>``), the name
its senders, an operator's ``celery call`` and the routes (``config/settings.py``) use.
"""

from __future__ import annotations

import socket

from celery import Task, shared_task

from attestations.workers.models import WorkerHeartbeat
from attestations.workers.presence import PRESENCE_TASK, announce, library_versions


@shared_task(
    name="attestations.workers.tasks.heartbeat", acks_late=True, reject_on_worker_lost=True
)
def heartbeat(token: str) -> str:
    """Record that a worker ran; idempotent on ``token`` so a redelivery is harmless."""
    row, _ = WorkerHeartbeat.objects.get_or_create(
        token=token, defaults={"hostname": socket.gethostname()}
    )
    return row.hostname


@shared_task(bind=True, name=PRESENCE_TASK, ignore_result=True)
def replay_presence(self: Task, queue: str) -> list[str]:  # type: ignore[type-arg]
    """Announce the worker that took this message from replay ``queue``: sent by hand
    (``celery -A config call attestations.workers.tasks.replay_presence --args='["replay-tpu"]'
    --queue replay-tpu``), it checks that the queue has a live consumer."""
    return announce(self.request.hostname or socket.gethostname(), [queue], library_versions())
