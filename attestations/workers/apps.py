from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig

log = logging.getLogger(__name__)

#: How often a replay worker renews its announcement (well inside the TTL it is judged by).
PRESENCE_SECONDS = 60.0


def _refresh(hostname: str, queues: list[str]) -> None:
    """Renew the worker's announcement; a database hiccup only delays the next one."""
    from django.db import close_old_connections

    from attestations.workers.presence import announce

    try:
        close_old_connections()  # the main process holds its connection for days
        announce(hostname, queues)
    except Exception:
        log.warning("could not renew the replay worker's announcement", exc_info=True)


def _worker_ready(sender: Any = None, **_: Any) -> None:
    """A worker started: announce the replay queues it consumes (``-Q``), and renew the
    announcement on the consumer's own timer, so an idle worker stays counted alive
    (nothing is queued for it: a queue no worker consumes gathers no messages)."""
    from attestations.workers.presence import announce, library_versions

    hostname = str(sender.hostname)
    queues = list(sender.app.amqp.queues.consume_from)
    announce(hostname, queues, library_versions())
    timer = getattr(sender, "timer", None)
    if timer is not None:
        timer.call_repeatedly(PRESENCE_SECONDS, _refresh, (hostname, queues))


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
