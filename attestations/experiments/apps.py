from __future__ import annotations

from django.apps import AppConfig


class ExperimentsConfig(AppConfig):
    """Experiments registered in advance, and the versions of their declared spec."""

    name = "attestations.experiments"
    verbose_name = "Experiments"
    default_auto_field = "django.db.models.BigAutoField"
