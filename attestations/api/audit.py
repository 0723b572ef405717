"""The API of the audit trail: ``audit-events/`` (not for regulators)."""

from __future__ import annotations

from datetime import datetime

from django.db.models import QuerySet
from rest_framework import generics, serializers

from attestations.accounts.models import (
    Capability,
    Organization,
)
from attestations.audit.models import AuditEvent
from attestations.http.filters import QueryFilters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, get_access


class AuditEventSerializer(serializers.ModelSerializer[AuditEvent]):
    actor = serializers.CharField(source="actor_name", read_only=True)
    # Null for an event of no organisation (an API key created or revoked).
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True
    )

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created",
            "actor",
            "organization",
            "action",
            "target_type",
            "target_id",
            "detail",
            "ip",
        ]


class AuditEventList(generics.ListAPIView[AuditEvent]):
    """The append-only audit trail of the organisations the caller audits."""

    serializer_class = AuditEventSerializer
    permission_classes = [HasCapability]
    required_capability = Capability.AUDIT
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "action": ("action", None),
        "organization": ("organization__slug", None),
        "target_type": ("target_type", None),
        "target_id": ("target_id", None),
        "after": ("created__gte", datetime),
        "before": ("created__lt", datetime),
    }

    def get_queryset(self) -> QuerySet[AuditEvent]:
        queryset = AuditEvent.objects.filter(get_access(self.request).orgs(Capability.AUDIT))
        return queryset.select_related("organization")
