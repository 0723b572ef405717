"""Django admin: the audit trail, read-only."""

from __future__ import annotations

from django.contrib import admin

from attestations.audit.models import AuditEvent
from attestations.core.admin import ReadOnlyAdmin


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["created", "actor_name", "organization", "action", "target_type", "target_id"]
    list_filter = ["action"]
