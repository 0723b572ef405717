from __future__ import annotations

from django.apps import AppConfig


class UploadsConfig(AppConfig):
    """Blobs stored under their content address, and the resumable uploads that bring them."""

    name = "attestations.uploads"
    verbose_name = "Uploads"
    default_auto_field = "django.db.models.BigAutoField"
