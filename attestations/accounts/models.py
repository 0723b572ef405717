"""Organisations, their members and roles, invitations, and personal API keys.

Behaviour lives here (fat models, thin views): the kinds of organisation (a lab trains
and files proofs; an agency holds regulators), the access rules of :class:`Membership`
and :class:`Access`, consent to join (:class:`Invitation`), and issuing and checking
:class:`ApiKey`. Every change is recorded in the audit trail (``attestations.audit``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from typing import Any, ClassVar

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import connections, models, router, transaction
from django.db.models import Q
from django.utils import timezone

from attestations.accounts.errors import (
    AgencyMembersError,
    AlreadyMemberError,
    InvitationClosedError,
    InvitationRequiredError,
    LastAdminError,
    RegulatorConflictError,
    RoleNotAllowedError,
)
from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import DVBenchError, InvalidRequestError
from attestations.core.validators import slug_validator

# --- Organisations and roles ------------------------------------------------------------


class OrganizationKind(models.TextChoices):
    """A lab trains and files proofs; an agency holds regulators, who read every lab."""

    LAB = "lab", "Lab"
    AGENCY = "agency", "Agency (regulators)"


class Organization(models.Model):
    """A lab or agency. Its slug is the ``owner`` half of ``owner/name`` experiment ids.

    Only the platform's operator creates organisations and decides their kind (the Django
    admin, ``manage.py agency``): an agency's members are regulators, and a regulator
    reads the claims of every organisation, so that power never comes from a lab.
    """

    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    kind = models.CharField(
        max_length=8, choices=OrganizationKind.choices, default=OrganizationKind.LAB
    )
    created = models.DateTimeField(default=timezone.now)
    #: The per-organisation key challenge seeds derived from before the v3 seed context
    #: (hex, never shown). No longer read: every seed now derives from the platform-wide
    #: key, :func:`attestations.challenges.secret.challenge_key`; the column is kept.
    challenge_key = models.CharField(max_length=64, blank=True, editable=False)

    class Meta:
        db_table = "attestations_organization"
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_agency(self) -> bool:
        return self.kind == OrganizationKind.AGENCY

    def roles_allowed(self) -> frozenset[str]:
        """The roles a member of this organisation may hold."""
        return AGENCY_ROLES if self.is_agency else LAB_ROLES

    def clean(self) -> None:
        """Refuse a change of kind that would leave members with roles the kind forbids."""
        from django.core.exceptions import ValidationError

        if self._state.adding:
            return
        wrong = self.memberships.exclude(role__in=self.roles_allowed())
        if wrong.exists():
            roles = sorted(set(wrong.values_list("role", flat=True)))
            raise ValidationError(
                {
                    "kind": f"{self.slug} has members with the role(s) {', '.join(roles)}, "
                    f"which a{'n agency' if self.is_agency else ' lab'} cannot hold; "
                    "remove them first"
                }
            )
        if self.is_agency and self.experiments.exists():
            raise ValidationError(
                {"kind": f"{self.slug} owns experiments; an agency cannot own experiments"}
            )


class Role(models.TextChoices):
    TRAINER = "trainer", "Trainer"
    AUDITOR = "auditor", "Auditor"
    REGULATOR = "regulator", "Regulator"
    ADMIN = "admin", "Admin"


class Capability(models.TextChoices):
    """What a role may do inside its organisation.

    ``read`` covers claims: experiments, specs, proof verdicts, jobs, certificates.
    ``audit`` covers the organisation's audit trail. ``artifacts`` covers the bytes a lab
    uploaded (transcripts, snapshots, batches) and the upload sessions that carry them.
    ``write`` registers experiments and uploads; ``manage`` changes memberships.
    """

    READ = "read"
    AUDIT = "audit"
    ARTIFACTS = "artifacts"
    WRITE = "write"
    MANAGE = "manage"


ROLE_CAPABILITIES: Mapping[str, frozenset[str]] = {
    Role.TRAINER: frozenset({"read", "audit", "artifacts", "write"}),
    Role.ADMIN: frozenset({"read", "audit", "artifacts", "write", "manage"}),
    Role.AUDITOR: frozenset({"read", "audit"}),
    # A regulator reads claims in every organisation (see Access.read_all) but never
    # artifacts: weights and data are the lab's secrets (DESIGN.md section 7).
    Role.REGULATOR: frozenset({"read"}),
}

#: Roles a lab's members hold; its admins grant them (with the member's consent).
LAB_ROLES: frozenset[str] = frozenset({Role.TRAINER, Role.AUDITOR, Role.ADMIN})
#: The lab roles as form and serializer choices, in the order of ``Role``.
LAB_ROLE_CHOICES: list[tuple[str, str]] = [
    (role, label) for role, label in Role.choices if role in LAB_ROLES
]
#: The only role in an agency; granted by the platform's operator alone.
AGENCY_ROLES: frozenset[str] = frozenset({Role.REGULATOR})


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
        _not_an_agency(organization)
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


def _not_an_agency(organization: Organization) -> None:
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
        _not_an_agency(organization)
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


def remember_memberships(user: AbstractBaseUser, rows: list[tuple[int, str, str]]) -> None:
    """Attach a user's memberships as read with the user (see :func:`_memberships`).

    Only for a user object built for one request: :class:`Access` reads these instead of
    querying again.
    """
    user._dvbench_memberships = [(int(org), str(role), str(kind)) for org, role, kind in rows]  # type: ignore[attr-defined]


def _memberships(user: AbstractBaseUser) -> list[tuple[int, str, str]]:
    """``(organization_id, role, organization kind)`` of each of a user's memberships.

    Every request computes :class:`Access` from this, so it runs one SQL statement built
    once from the models' metadata: the same query through the ORM
    (``Membership.objects.filter(user=...).values_list(..., "organization__kind")``) spent
    longer compiling than PostgreSQL spent running it.
    """
    # The key authentication read them in its own query, for this request's user object.
    known: list[tuple[int, str, str]] | None = getattr(user, "_dvbench_memberships", None)
    if known is not None:
        return known
    connection = connections[router.db_for_read(Membership)]
    with connection.cursor() as cursor:
        cursor.execute(_membership_sql(connection.alias), [user.pk])
        return [(int(org), str(role), str(kind)) for org, role, kind in cursor.fetchall()]


@cache
def _membership_sql(alias: str) -> str:
    quote = connections[alias].ops.quote_name

    def column(model: type[models.Model], name: str) -> str:
        field = model._meta.get_field(name)
        assert isinstance(field, models.Field)
        return quote(str(field.column))

    # Only names from the models' metadata, quoted; the user id is a parameter.
    members, orgs = quote(Membership._meta.db_table), quote(Organization._meta.db_table)
    return (
        f"SELECT m.{column(Membership, 'organization')}, m.{column(Membership, 'role')}, "  # noqa: S608
        f"o.{column(Organization, 'kind')} FROM {members} m JOIN {orgs} o "
        f"ON o.{column(Organization, 'id')} = m.{column(Membership, 'organization')} "
        f"WHERE m.{column(Membership, 'user')} = %s"
    )


@dataclass(frozen=True)
class Access:
    """What one user may do, computed once per request from their memberships.

    Views never look at roles directly; they ask ``access.can(capability, org_id)`` or
    scope a queryset with ``access.orgs(capability)``.
    """

    roles: Mapping[int, str]
    read_all: bool
    superuser: bool = False
    regulator: bool = False

    @classmethod
    def for_user(cls, user: AbstractBaseUser | AnonymousUser) -> Access:
        if not isinstance(user, User) or not user.is_authenticated:
            return cls(roles={}, read_all=False)
        roles: dict[int, str] = {}
        regulator = False
        for org, role, kind in _memberships(user):
            roles[org] = role
            # Cross-organisation reading comes only from the operator: a regulator role
            # held in an agency. A "regulator" row in a lab (left from before agencies
            # existed) reads that lab only.
            regulator = regulator or (role == Role.REGULATOR and kind == OrganizationKind.AGENCY)
        superuser = bool(getattr(user, "is_superuser", False))
        return cls(
            roles=roles,
            read_all=superuser or regulator,
            superuser=superuser,
            regulator=regulator,
        )

    def can(self, capability: str, organization_id: int) -> bool:
        if self.superuser:
            return True
        if capability == Capability.READ and self.read_all:
            return True
        role = self.roles.get(organization_id)
        return role is not None and capability in ROLE_CAPABILITIES[role]

    def can_see(self, organization_id: int) -> bool:
        """Whether the organisation's objects exist for this user at all (else 404)."""
        return self.can(Capability.READ, organization_id)

    def orgs(self, capability: str, field: str = "organization_id") -> Q:
        """A filter on ``field`` for the organisations where ``capability`` holds."""
        ids = self.org_ids(capability)
        return Q() if ids is None else Q(**{f"{field}__in": ids})

    def org_ids(self, capability: str) -> list[int] | None:
        """The organisations where ``capability`` holds; None for every organisation."""
        if self.superuser or (capability == Capability.READ and self.read_all):
            return None
        return [org for org, role in self.roles.items() if capability in ROLE_CAPABILITIES[role]]

    def any(self, capability: str) -> bool:
        return (
            self.superuser
            or any(capability in ROLE_CAPABILITIES[role] for role in self.roles.values())
            or (capability == Capability.READ and self.read_all)
        )

    @property
    def is_regulator(self) -> bool:
        return self.regulator


# --- API keys ---------------------------------------------------------------------------

API_KEY_PREFIX = "dvb"


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        return self.filter(revoked__isnull=True, expires__gt=timezone.now())


class ApiKey(models.Model):
    """A personal API key: ``dvb_<lookup>_<secret>``.

    Only the SHA-256 of the whole key is stored. The secret has 256 bits of entropy, so a
    fast hash is the right tool (a slow password hash would only slow every API request);
    ``lookup`` is a random public prefix that finds the row without a scan, and the
    digest comparison is constant-time.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    revoked = models.DateTimeField(null=True, blank=True)
    last_used = models.DateTimeField(null=True, blank=True)

    objects: ClassVar[ApiKeyQuerySet] = ApiKeyQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        db_table = "attestations_apikey"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def prefix(self) -> str:
        """The part of the key that is safe to show again: it identifies, never authenticates."""
        return f"{API_KEY_PREFIX}_{self.lookup}"

    @property
    def is_active(self) -> bool:
        return self.revoked is None and self.expires > timezone.now()

    @staticmethod
    def hash(raw: str) -> str:
        return hashlib.sha256(raw.encode("utf-8")).hexdigest()

    @classmethod
    def issue(
        cls, user: User, name: str, *, days: int | None = None, ip: str | None = None
    ) -> tuple[ApiKey, str]:
        """Create a key and return it with its raw value, which is never retrievable again.

        Records ``api_key.created`` in the audit trail. Only a signed-in user who confirmed
        their password creates keys through the web or the API, never a key
        (``attestations/http/sudo.py``).

        Raises:
            InvalidRequestError: ``days`` outside 1..``DVBENCH["API_KEY_MAX_DAYS"]`` (400
                ``invalid``, field ``days``): no key outlives the policy.
        """
        ttl = days if days is not None else dvbench_int("API_KEY_TTL_DAYS")
        longest = dvbench_int("API_KEY_MAX_DAYS")
        if not 1 <= ttl <= longest:
            raise InvalidRequestError(
                f"days: a key lives 1 to {longest} days (DVBENCH_API_KEY_MAX_DAYS); got {ttl}.",
                field="days",
                detail={"min": 1, "max": longest, "got": ttl},
            )
        lookup = secrets.token_hex(6)
        raw = f"{API_KEY_PREFIX}_{lookup}_{secrets.token_urlsafe(32)}"
        key = cls.objects.create(
            user=user,
            name=name,
            lookup=lookup,
            digest=cls.hash(raw),
            expires=timezone.now() + timedelta(days=ttl),
        )
        AuditEvent.record(
            "api_key.created",
            actor=user,
            target=key,
            detail={"name": key.name, "prefix": key.prefix, "expires": key.expires.isoformat()},
            ip=ip,
        )
        return key, raw

    @classmethod
    def authenticate(cls, raw: str) -> ApiKey | None:
        """Return the active key matching ``raw``, or None. Records ``last_used``."""
        parts = raw.split("_", 2)
        if len(parts) != 3 or parts[0] != API_KEY_PREFIX:
            return None
        key = cls.objects.select_related("user").filter(lookup=parts[1]).first()
        if key is None or not hmac.compare_digest(key.digest, cls.hash(raw)):
            return None
        if not key.is_active:
            return None
        now = timezone.now()
        # One write a minute at most: an API client polling a job must not turn every
        # read into a row update.
        if key.last_used is None or now - key.last_used > timedelta(minutes=1):
            cls.objects.filter(pk=key.pk).update(last_used=now)
            key.last_used = now
        return key

    def revoke(self, *, actor: User | None = None, ip: str | None = None) -> bool:
        """Revoke the key (recording ``api_key.revoked``); False if it already was."""
        updated = ApiKey.objects.filter(pk=self.pk, revoked__isnull=True).update(
            revoked=timezone.now()
        )
        self.refresh_from_db(fields=["revoked"])
        if updated:
            AuditEvent.record(
                "api_key.revoked",
                actor=actor,
                target=self,
                detail={"name": self.name, "prefix": self.prefix},
                ip=ip,
            )
        return bool(updated)
