"""Django admin: operators manage organisations and memberships; records are read-only.

The admin site is the operator's (staff accounts): it is one of the two places an agency
is made and the regulator role granted (the other is ``manage.py agency``). The rules of
``Membership.clean`` and ``Organization.clean`` hold here too: a regulator only in an
agency, nobody in both a lab and an agency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest

from attestations.models import (
    ApiKey,
    AuditEvent,
    Blob,
    Challenge,
    Experiment,
    ExperimentSpec,
    Invitation,
    Job,
    Membership,
    Organization,
    Proof,
    ProofArtifact,
    Upload,
)

# django-stubs makes ModelAdmin generic; at runtime (without django_stubs_ext) it is not
# subscriptable, so only the type checker sees the parameters.
if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
    _TabularInline = admin.TabularInline[Any, Any]
else:
    _ModelAdmin = admin.ModelAdmin
    _TabularInline = admin.TabularInline


class MembershipInline(_TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]


@admin.register(Organization)
class OrganizationAdmin(_ModelAdmin):
    list_display = ["slug", "name", "kind", "created"]
    list_filter = ["kind"]
    search_fields = ["slug", "name"]
    fields = ["slug", "name", "kind", "created"]
    inlines = [MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(_ModelAdmin):
    list_display = ["prefix", "name", "user", "created", "expires", "revoked", "last_used"]
    readonly_fields = ["lookup", "digest", "created", "last_used"]
    search_fields = ["lookup", "name", "user__username"]


class ReadOnlyAdmin(_ModelAdmin):
    """Records written by the platform itself: an operator may look, never edit."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Invitation)
class InvitationAdmin(ReadOnlyAdmin):
    list_display = ["organization", "user", "role", "status", "invited_by", "created", "expires"]
    list_filter = ["status"]


@admin.register(Experiment)
class ExperimentAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "created", "created_by"]


@admin.register(ExperimentSpec)
class ExperimentSpecAdmin(ReadOnlyAdmin):
    list_display = ["experiment", "version", "digest", "framework"]


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


@admin.register(Upload)
class UploadAdmin(ReadOnlyAdmin):
    list_display = ["id", "experiment", "kind", "size", "status", "created"]


@admin.register(Blob)
class BlobAdmin(ReadOnlyAdmin):
    list_display = ["sha256", "size", "created"]


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["created", "actor_name", "organization", "action", "target_type", "target_id"]
    list_filter = ["action"]
