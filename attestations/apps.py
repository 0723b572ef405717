"""The root app ``attestations``: it holds no models and no migrations.

It is an app only so that Django finds ``manage.py demo``
(``attestations/management/commands/demo.py``); the domain apps are its subpackages.
"""

from __future__ import annotations

from django.apps import AppConfig


class AttestationsConfig(AppConfig):
    name = "attestations"
    verbose_name = "DVBench attestations"
    default_auto_field = "django.db.models.BigAutoField"
