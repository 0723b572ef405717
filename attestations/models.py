"""Models of the platform as a whole, owned by no domain app.

The domain models live in the apps under ``attestations/`` (README, "Layout"); this app
keeps only the worker heartbeat that ``/health`` and the Celery smoke test write.
"""

from __future__ import annotations

from django.db import models


class WorkerHeartbeat(models.Model):
    """A row written by a Celery worker: proof that the broker and worker round-trip works."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"heartbeat {self.token} from {self.hostname}"
