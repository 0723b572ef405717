"""The Celery app of the worker-kill test's workers: the platform's, sweeping faster.

Redis keeps a delivered but unacknowledged message aside until its visibility timeout
passes; a worker then restores it in a sweep that by default runs about every 100 s.
The kill test's workers sweep every second so that the redelivery after SIGKILL takes
seconds, not minutes. Nothing else differs from ``config.celery_app``.
"""

from __future__ import annotations

from config.celery_app import app

app.conf.broker_transport_options = {
    **(app.conf.broker_transport_options or {}),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

__all__ = ["app"]
