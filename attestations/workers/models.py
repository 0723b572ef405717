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


class ReplayWorker(models.Model):
    """A Celery worker that consumes a replay queue: which platform kind it serves.

    Written by the worker itself (``attestations.workers.presence``): when it starts,
    whenever it runs the periodic presence task sent to its queue, and after each
    replay, with the replay environment it ran in. The platform routes a run's replays
    to the queue of its platform kind only while a worker of that kind has been seen
    (``docs/operators.md``, "Replay queues").
    """

    hostname = models.CharField(max_length=255)
    queue = models.CharField(max_length=64)
    kind = models.CharField(max_length=16, db_index=True)
    #: What it replays with: library versions at start, the prover's replay environment
    #: (``zkdv.environments``) once it has replayed.
    environment = models.JSONField(default=dict)
    started = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(db_index=True)

    class Meta:
        db_table = "attestations_replayworker"
        constraints = [
            models.UniqueConstraint(fields=["hostname", "queue"], name="replay_worker_unique")
        ]
        ordering = ["kind", "hostname"]

    def __str__(self) -> str:
        return f"{self.hostname} on {self.queue} ({self.kind})"
