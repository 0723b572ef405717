"""Django admin: operators manage organisations and memberships; records are read-only.

The admin site is the operator's (staff accounts): it is one of the two places an agency
is made and the regulator role granted (the other is ``manage.py agency``). The rules of
``Membership.clean`` and ``Organization.clean`` hold here too: a regulator only in an
agency, nobody in both a lab and an agency.
"""

from __future__ import annotations

from django.contrib import admin

from attestations.challenges.models import Challenge
from attestations.core.admin import ReadOnlyAdmin
from attestations.proofs.models import Job, Proof, ProofArtifact


@admin.register(Proof)
class ProofAdmin(ReadOnlyAdmin):
    list_display = ["pk", "experiment", "status", "reason", "created"]
    list_filter = ["status"]


@admin.register(Challenge)
class ChallengeAdmin(ReadOnlyAdmin):
    """What the platform asked a proof to answer, and how each replay went."""

    list_display = ["pk", "proof", "step", "through", "origin", "status", "reason", "created"]
    list_filter = ["status", "origin"]
    search_fields = ["reason", "message"]
    list_select_related = ["proof"]
    raw_id_fields = ["proof"]


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
