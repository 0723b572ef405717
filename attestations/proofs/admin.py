"""Django admin: filed proofs, their attached files and background jobs, read-only."""

from __future__ import annotations

from django.contrib import admin

from attestations.core.admin import ReadOnlyAdmin
from attestations.proofs.models import Job, Proof, ProofArtifact


@admin.register(Proof)
class ProofAdmin(ReadOnlyAdmin):
    list_display = ["pk", "experiment", "status", "reason", "created"]
    list_filter = ["status"]


@admin.register(ProofArtifact)
class ProofArtifactAdmin(ReadOnlyAdmin):
    """Files attached to a proof: names and digests only; the bytes stay in storage."""

    list_display = ["pk", "proof", "name", "kind", "size", "sha256", "created"]
    list_filter = ["kind"]
    search_fields = ["name", "sha256"]
    list_select_related = ["proof"]
    raw_id_fields = ["proof", "blob", "created_by"]


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "kind", "status", "progress", "created"]
