"""Models of the attestations app."""

from __future__ import annotations

from django.db import models


class WorkerHeartbeat(models.Model):
    """A row written by a Celery worker: proof that the broker and worker round-trip works."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"heartbeat {self.token} from {self.hostname}"
