from __future__ import annotations

from django.apps import AppConfig


class AttestationsConfig(AppConfig):
    name = "attestations"
    verbose_name = "DVBench attestations"
    default_auto_field = "django.db.models.BigAutoField"
