"""Django admin: operators manage organisations and memberships.

It is one of the two places an agency is made and the regulator role granted (the other
is ``manage.py agency``). The rules of ``Membership.clean`` and ``Organization.clean``
hold here too: a regulator only in an agency, nobody in both a lab and an agency.
"""

from __future__ import annotations

from django.contrib import admin

from attestations.accounts.models import ApiKey, Invitation, Membership, Organization
from attestations.core.admin import ModelAdmin, ReadOnlyAdmin, TabularInline


class MembershipInline(TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]


@admin.register(Organization)
class OrganizationAdmin(ModelAdmin):
    list_display = ["slug", "name", "kind", "created"]
    list_filter = ["kind"]
    search_fields = ["slug", "name"]
    fields = ["slug", "name", "kind", "created"]
    inlines = [MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(ModelAdmin):
    list_display = ["prefix", "name", "user", "created", "expires", "revoked", "last_used"]
    readonly_fields = ["lookup", "digest", "created", "last_used"]
    search_fields = ["lookup", "name", "user__username"]


@admin.register(Invitation)
class InvitationAdmin(ReadOnlyAdmin):
    # ``user`` is empty where the username named nobody who may join (nobody can accept).
    list_display = [
        "organization",
        "username",
        "user",
        "role",
        "status",
        "invited_by",
        "created",
        "expires",
    ]
    list_filter = ["status"]
