"""Memberships: a user's role in one organisation, and the rules every change obeys.

The rules hold on every path (API, web, Django admin, ``manage.py agency``): a lab's
members are trainers, auditors or admins and an agency's are regulators; nobody is on
both sides; nobody joins without consenting; a lab keeps an admin. Every change is
recorded in the audit trail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import models, transaction
from django.utils import timezone

from attestations.accounts.errors import (
    AgencyMembersError,
    AlreadyMemberError,
    InvitationRequiredError,
    LastAdminError,
    RegulatorConflictError,
    RoleNotAllowedError,
)
from attestations.accounts.models.organizations import Organization, OrganizationKind, Role
from attestations.audit.models import AuditEvent
from attestations.core.errors import DVBenchError


def _lock_user(user: User) -> None:
    """Serialise membership changes of one user (the lab/agency rule spans their rows)."""
    User.objects.select_for_update().filter(pk=user.pk).exists()


class Membership(models.Model):
    """A user's role in one organisation.

    The rules every path enforces (API, web, Django admin, ``manage.py agency``):

    * a lab's members are trainers, auditors or admins; an agency's are regulators;
    * nobody is both: a regulator belongs to no lab, a lab member to no agency;
    * nobody joins a lab without consenting (an :class:`Invitation` they accept);
    * a lab keeps at least one admin.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_membership"
        constraints = [
            models.UniqueConstraint(fields=["user", "organization"], name="one_role_per_org")
        ]
        ordering = ["organization__slug", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} {self.role} in {self.organization}"

    def clean(self) -> None:
        """Model validation (the Django admin's path): the role and lab/agency rules."""
        from django.core.exceptions import ValidationError

        if not (self.organization_id and self.user_id):
            return  # Django reports the missing field itself
        try:
            check_role(self.organization, self.user, self.role)
        except DVBenchError as error:
            raise ValidationError({"role": error.message}) from None

    @classmethod
    def change_role(
        cls,
        organization: Organization,
        user: User,
        role: str,
        *,
        actor: User,
        ip: str | None = None,
    ) -> Membership:
        """Change an existing member's role; recorded as ``membership.changed``.

        Raises:
            InvitationRequiredError: ``user`` is not a member (they join by accepting an
                invitation, never by an admin's say-so).
            RoleNotAllowedError: the role is not one this organisation's members hold.
            LastAdminError: the change would leave the lab with no admin.
        """
        check_not_an_agency(organization)
        with transaction.atomic():
            check_role(organization, user, role, joining=False)
            membership = (
                cls.objects.select_for_update().filter(organization=organization, user=user).first()
            )
            if membership is None:
                raise not_a_member(organization, user.get_username())
            if membership.role == role:
                return membership
            if membership.role == Role.ADMIN:
                _keep_an_admin(organization, leaving=membership)
            previous, membership.role = membership.role, role
            membership.save(update_fields=["role"])
            AuditEvent.record(
                "membership.changed",
                actor=actor,
                organization=organization,
                target=membership,
                detail={"username": user.get_username(), "role": role, "previous": previous},
                ip=ip,
            )
        return membership

    @classmethod
    def join(
        cls,
        organization: Organization,
        user: User,
        role: str,
        *,
        actor: User | None,
        ip: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Membership:
        """Make ``user`` a member: only for an accepted invitation or the operator's command.

        Raises:
            RoleNotAllowedError, RegulatorConflictError: see :func:`check_role`.
            AlreadyMemberError: ``user`` is a member already.
        """
        with transaction.atomic():
            _lock_user(user)
            check_role(organization, user, role)
            if cls.objects.filter(organization=organization, user=user).exists():
                raise AlreadyMemberError(
                    f"{user.get_username()} is already a member of {organization.slug}",
                    field="username",
                )
            membership = cls.objects.create(user=user, organization=organization, role=role)
            AuditEvent.record(
                "membership.added",
                actor=actor,
                organization=organization,
                target=membership,
                detail={"username": user.get_username(), "role": role, **dict(detail or {})},
                ip=ip,
            )
        return membership

    def remove(self, *, actor: User | None, ip: str | None = None) -> None:
        """Delete the membership, recording ``membership.removed`` first.

        Raises:
            LastAdminError: this is the lab's last admin.
        """
        with transaction.atomic():
            if self.role == Role.ADMIN:
                _keep_an_admin(self.organization, leaving=self)
            AuditEvent.record(
                "membership.removed",
                actor=actor,
                organization=self.organization,
                target=self,
                detail={"username": self.user.get_username(), "role": self.role},
                ip=ip,
            )
            self.delete()


def not_a_member(organization: Organization, username: str) -> InvitationRequiredError:
    """The one answer for a role change of anyone who is not a member, existing or not."""
    return InvitationRequiredError(
        f"{username} is not a member of {organization.slug}: invite them (POST "
        f"/api/v1/organizations/{organization.slug}/invitations/); they join when they accept",
        field="username",
        detail={"username": username},
    )


def check_role_allowed(organization: Organization, role: str) -> None:
    """Refuse a role the organisation's kind forbids (whoever would hold it).

    Raises:
        RoleNotAllowedError: a regulator in a lab, or anything but a regulator in an agency.
    """
    allowed = organization.roles_allowed()
    if role not in allowed:
        if role == Role.REGULATOR:
            message = (
                f"{organization.slug} is a lab; the regulator role exists only in an agency "
                "organisation, and only the platform's operator grants it (manage.py agency)"
            )
        else:
            message = (
                f"{organization.slug} is an agency: its members are regulators, granted by "
                "the platform's operator"
            )
        raise RoleNotAllowedError(
            message, field="role", detail={"allowed": sorted(allowed), "got": role}
        )


def check_role(organization: Organization, user: User, role: str, *, joining: bool = True) -> None:
    """Refuse a role the organisation's kind forbids, or a user on both sides of the line.

    Raises:
        RoleNotAllowedError: a regulator in a lab, or anything but a regulator in an agency.
        RegulatorConflictError: a regulator joining a lab, or a lab member an agency.
    """
    check_role_allowed(organization, role)
    if not joining:
        return
    others = Membership.objects.filter(user=user).exclude(organization=organization)
    if organization.is_agency:
        clash = others.filter(organization__kind=OrganizationKind.LAB).select_related(
            "organization"
        )
        if (first := clash.first()) is not None:
            raise RegulatorConflictError(
                f"{user.get_username()} is a member of the lab {first.organization.slug}; a "
                "regulator reads every lab, so they must leave their labs first",
                field="username",
                detail={"lab": first.organization.slug},
            )
    else:
        clash = others.filter(organization__kind=OrganizationKind.AGENCY).select_related(
            "organization"
        )
        if (first := clash.first()) is not None:
            raise RegulatorConflictError(
                f"{user.get_username()} is a regulator (agency {first.organization.slug}); a "
                "regulator cannot be a member of a lab",
                field="username",
                detail={"agency": first.organization.slug},
            )


def check_not_an_agency(organization: Organization) -> None:
    """Agencies are not managed through invitations or role changes: the operator's alone."""
    if organization.is_agency:
        raise AgencyMembersError(
            f"{organization.slug} is an agency: its members are regulators, whom only the "
            "platform's operator appoints (manage.py agency grant)",
            field="username",
        )


def _keep_an_admin(organization: Organization, *, leaving: Membership) -> None:
    """Refuse to demote or remove a lab's last admin (the lab could never be managed again)."""
    if organization.is_agency:
        return
    # Locked, so two admins demoting each other at once cannot both succeed.
    admins = list(
        Membership.objects.select_for_update()
        .filter(organization=organization, role=Role.ADMIN)
        .exclude(pk=leaving.pk)
        .values_list("pk", flat=True)
    )
    if not admins:
        raise LastAdminError(
            f"{leaving.user.get_username()} is the last admin of {organization.slug}; make "
            "another member admin first, so the organisation can still be managed",
            field="username",
            detail={"username": leaving.user.get_username()},
        )
