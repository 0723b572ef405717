"""Invitations: consent to join a lab, offered by its admins and accepted by the invitee."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from attestations.accounts.errors import (
    AlreadyMemberError,
    InvitationClosedError,
    RegulatorConflictError,
)
from attestations.accounts.models.memberships import (
    Membership,
    check_not_an_agency,
    check_role,
    check_role_allowed,
)
from attestations.accounts.models.organizations import Organization, Role
from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int


def _invitable(organization: Organization, username: str, role: str) -> User | None:
    """The active user ``username`` if they may join ``organization`` with ``role``, else None.

    None for no such user, an inactive one and a regulator alike: the caller answers the
    same in every case.
    """
    user = User.objects.filter(username=username, is_active=True).first()
    if user is None:
        return None
    try:
        check_role(organization, user, role)
    except RegulatorConflictError:
        return None
    return user


class InvitationStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    ACCEPTED = "accepted", "Accepted"
    DECLINED = "declined", "Declined"
    REVOKED = "revoked", "Revoked"
    EXPIRED = "expired", "Expired"


class Invitation(models.Model):
    """An admin's offer of a role in a lab; the user becomes a member only by accepting it.

    Nobody is put in an organisation without consenting: membership gives the member's
    own API keys power in that lab, and shows them its data.

    An invitation is to a *username*, and the inviter learns nothing from it: one to a
    name nobody holds, to an inactive account or to a regulator (who may join no lab) is
    recorded, listed, audited and answered exactly as any other, but has no ``user``, so
    nobody ever sees or accepts it; it expires like the rest (issue 34).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="invitations"
    )
    #: What the admin typed. ``user`` is that account only if it may join this lab.
    username = models.CharField(max_length=150)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="invitations",
        null=True,
        blank=True,
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    status = models.CharField(
        max_length=16, choices=InvitationStatus.choices, default=InvitationStatus.PENDING
    )
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    responded = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "attestations_invitation"
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "username"],
                condition=Q(status="pending"),
                name="one_pending_invitation_per_username",
            )
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return (
            f"invitation of {self.username} to {self.organization} as {self.role} ({self.status})"
        )

    @property
    def is_pending(self) -> bool:
        return self.status == InvitationStatus.PENDING and self.expires > timezone.now()

    @classmethod
    def pending_for(cls, user: User) -> models.QuerySet[Invitation]:
        return cls.objects.filter(
            user=user, status=InvitationStatus.PENDING, expires__gt=timezone.now()
        ).select_related("organization", "invited_by")

    @classmethod
    def offer(
        cls,
        organization: Organization,
        username: str,
        role: str,
        *,
        actor: User,
        ip: str | None = None,
    ) -> tuple[Invitation, bool]:
        """Invite ``username`` to a lab with ``role``, or change the role a pending one offers.

        The answer is the same whether ``username`` names an active user who may join, no
        one, an inactive account or a regulator: only the first gets to see the
        invitation (``user`` is set); for the others it is kept, listed and expires, but
        nobody can accept it. The inviter learns nothing about the name.

        Returns:
            The invitation and whether it is new.

        Raises:
            AgencyMembersError: ``organization`` is an agency (the operator's alone).
            RoleNotAllowedError: a role labs do not have (see :func:`check_role`).
            AlreadyMemberError: ``username`` is a member already (which the lab's admins
                see anyway; change their role instead).
        """
        ttl = timedelta(days=dvbench_int("INVITATION_TTL_DAYS"))
        check_not_an_agency(organization)
        with transaction.atomic():
            check_role_allowed(organization, role)
            user = _invitable(organization, username, role)
            if Membership.objects.filter(
                organization=organization, user__username=username
            ).exists():
                raise AlreadyMemberError(
                    f"{username} is already a member of {organization.slug}; "
                    f"change their role with POST /api/v1/organizations/{organization.slug}"
                    "/members/",
                    field="username",
                )
            now = timezone.now()
            cls.objects.filter(
                organization=organization,
                username=username,
                status=InvitationStatus.PENDING,
                expires__lte=now,
            ).update(status=InvitationStatus.EXPIRED)
            invitation = (
                cls.objects.select_for_update()
                .filter(
                    organization=organization, username=username, status=InvitationStatus.PENDING
                )
                .first()
            )
            created = invitation is None
            if invitation is None:
                invitation = cls.objects.create(
                    organization=organization,
                    username=username,
                    user=user,
                    role=role,
                    invited_by=actor,
                    expires=now + ttl,
                )
            else:
                invitation.role, invitation.invited_by, invitation.user = role, actor, user
                invitation.expires = now + ttl
                invitation.save(update_fields=["role", "invited_by", "user", "expires"])
            AuditEvent.record(
                "invitation.created" if created else "invitation.changed",
                actor=actor,
                organization=organization,
                target=invitation,
                detail={"username": username, "role": role},
                ip=ip,
            )
        return invitation, created

    def _respond(self, status: str, *, actor: User | None, ip: str | None) -> None:
        updated = Invitation.objects.filter(
            pk=self.pk, status=InvitationStatus.PENDING, expires__gt=timezone.now()
        ).update(status=status, responded=timezone.now())
        if not updated:
            self.refresh_from_db()
            state = self.status if self.status != InvitationStatus.PENDING else "expired"
            raise InvitationClosedError(
                f"this invitation to {self.organization.slug} is {state}",
                detail={"status": state},
            )
        self.refresh_from_db()
        AuditEvent.record(
            f"invitation.{status}",
            actor=actor,
            organization=self.organization,
            target=self,
            detail={"username": self.username, "role": self.role},
            ip=ip,
        )

    def accept(self, *, ip: str | None = None) -> Membership:
        """The invitee joins with the offered role (the rules are checked again now)."""
        # Only the invitee reaches an invitation to accept it (by ``user``), so it has one.
        assert self.user is not None, "an invitation nobody can see cannot be accepted"
        with transaction.atomic():
            self._respond(InvitationStatus.ACCEPTED, actor=self.user, ip=ip)
            invited_by = self.invited_by.get_username() if self.invited_by else None
            return Membership.join(
                self.organization,
                self.user,
                self.role,
                actor=self.user,
                ip=ip,
                detail={"invitation": str(self.pk), "invited_by": invited_by},
            )

    def decline(self, *, ip: str | None = None) -> None:
        self._respond(InvitationStatus.DECLINED, actor=self.user, ip=ip)

    def revoke(self, *, actor: User, ip: str | None = None) -> None:
        self._respond(InvitationStatus.REVOKED, actor=actor, ip=ip)
