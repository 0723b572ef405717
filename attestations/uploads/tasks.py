"""Celery tasks of uploads.

Task names keep the ``attestations.tasks.`` prefix they had before the apps were split:
they are the names in queued messages and in the beat schedule (``config/settings.py``).
"""

from __future__ import annotations

from celery import shared_task

from attestations.uploads import services


@shared_task(name="attestations.tasks.expire_uploads", acks_late=True)
def expire_uploads() -> int:
    """Remove the staged parts of uploads left open past their expiry (run periodically).

    Idempotent: an upload already expired is no longer open and is not touched again.
    """
    return services.expire_stale()
