from __future__ import annotations

from django.apps import AppConfig


class ReportsConfig(AppConfig):
    """Auditors' reports of a proof (HTML and PDF), and data-content queries."""

    name = "attestations.reports"
    verbose_name = "Reports"
    default_auto_field = "django.db.models.BigAutoField"
