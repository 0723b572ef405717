from __future__ import annotations

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    """The Celery workers' own record: the heartbeat a worker writes when it is asked."""

    name = "attestations.workers"
    verbose_name = "Workers"
    default_auto_field = "django.db.models.BigAutoField"
