"""Django admin: upload sessions and stored blobs, read-only."""

from __future__ import annotations

from django.contrib import admin

from attestations.core.admin import ReadOnlyAdmin
from attestations.uploads.models import Blob, Upload


@admin.register(Upload)
class UploadAdmin(ReadOnlyAdmin):
    list_display = ["id", "experiment", "kind", "size", "status", "created"]


@admin.register(Blob)
class BlobAdmin(ReadOnlyAdmin):
    list_display = ["sha256", "size", "created"]
