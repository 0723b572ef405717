"""The audit trail: who did what, when, from where. Rows are only ever inserted.

Every app records its events here (``AuditEvent.record``); this app knows the
organisation and the user of an event by foreign key only, so it imports no other app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from django.conf import settings
from django.contrib.auth.models import AnonymousUser, User
from django.db import models
from django.utils import timezone

from attestations.core.db import AppendOnlyModel, AppendOnlyQuerySet


class AuditEvent(AppendOnlyModel):
    """Who did what, when, from where. Rows are only ever inserted."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)
    organization = models.ForeignKey(
        "accounts.Organization",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    detail = models.JSONField(default=dict)
    ip = models.GenericIPAddressField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)

    objects: ClassVar[AppendOnlyQuerySet[AuditEvent]] = AppendOnlyQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        db_table = "attestations_auditevent"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.created:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action}"

    @classmethod
    def record(
        cls,
        action: str,
        *,
        actor: User | AnonymousUser | None = None,
        organization: models.Model | None = None,
        target: models.Model | None = None,
        detail: Mapping[str, Any] | None = None,
        ip: str | None = None,
    ) -> AuditEvent:
        user = actor if isinstance(actor, User) else None
        return cls.objects.create(
            actor=user,
            actor_name=user.get_username() if user is not None else "",
            # By id: this app knows organisations only through the foreign key.
            organization_id=organization.pk if organization is not None else None,
            action=action,
            target_type=target._meta.model_name or "" if target is not None else "",
            target_id=str(target.pk) if target is not None else "",
            detail=dict(detail or {}),
            ip=ip,
        )
