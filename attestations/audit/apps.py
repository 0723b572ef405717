from __future__ import annotations

from django.apps import AppConfig


class AuditConfig(AppConfig):
    """The append-only audit trail every app writes to."""

    name = "attestations.audit"
    verbose_name = "Audit trail"
    default_auto_field = "django.db.models.BigAutoField"
