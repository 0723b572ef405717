from __future__ import annotations

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    """Organisations (labs and agencies), members and roles, invitations, API keys."""

    name = "attestations.accounts"
    verbose_name = "Accounts"
    default_auto_field = "django.db.models.BigAutoField"
