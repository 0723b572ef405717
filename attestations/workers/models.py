"""The worker heartbeat: a row a Celery worker writes when asked, so a test or an operator
sees that a task went through the broker to a worker and its write reached the database.
"""

from __future__ import annotations

from django.db import models


class WorkerHeartbeat(models.Model):
    """A row written by a Celery worker: proof that the broker and worker round-trip works."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        # Created by the attestations app's first migration, when it held every model.
        db_table = "attestations_workerheartbeat"

    def __str__(self) -> str:
        return f"heartbeat {self.token} from {self.hostname}"
