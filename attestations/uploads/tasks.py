"""Celery tasks of uploads.

Each task is named after this module (``attestations.uploads.tasks.<function>``), the name
the beat schedule (``config/settings.py``) uses.
"""

from __future__ import annotations

from celery import shared_task

from attestations.uploads import services


@shared_task(name="attestations.uploads.tasks.expire_uploads", acks_late=True)
def expire_uploads() -> int:
    """Remove the staged parts of uploads left open past their expiry (run periodically).

    Idempotent: an upload already expired is no longer open and is not touched again.
    """
    return services.expire_stale()
