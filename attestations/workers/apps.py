from __future__ import annotations

from typing import Any

from django.apps import AppConfig


def _worker_ready(sender: Any = None, **_: Any) -> None:
    """A worker started: announce the replay queues it consumes (``-Q``)."""
    from attestations.workers.presence import announce, library_versions

    queues = list(sender.app.amqp.queues.consume_from)
    announce(str(sender.hostname), queues, library_versions())


def _worker_shutdown(sender: Any = None, **_: Any) -> None:
    """A worker stops: its queues no longer count as served."""
    from attestations.workers.presence import withdraw

    withdraw(str(sender.hostname))


class WorkersConfig(AppConfig):
    """The Celery workers' own records: the heartbeat a worker writes when it is asked,
    and the replay workers alive, with the platform kinds they serve."""

    name = "attestations.workers"
    verbose_name = "Workers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery.signals import worker_ready, worker_shutdown

        # Strong references: the handlers are module functions, kept for the process.
        worker_ready.connect(_worker_ready, weak=False, dispatch_uid="dvbench.replay_ready")
        worker_shutdown.connect(
            _worker_shutdown, weak=False, dispatch_uid="dvbench.replay_shutdown"
        )
