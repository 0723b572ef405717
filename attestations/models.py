"""Models of the attestations app.

Behaviour lives here (fat models, thin views): access rules on :class:`Membership`,
key issuing and checking on :class:`ApiKey`, spec canonicalisation and versioning on
:class:`Experiment` / :class:`ExperimentSpec`, and the verdict of a transcript on
:class:`Proof`. Logic that moves bytes through storage across several models lives in
``attestations/uploads.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.core.validators import RegexValidator
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

log = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
sha256_validator = RegexValidator(
    SHA256_HEX, "Enter a lowercase hex SHA-256 digest (64 characters)."
)
SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$")
slug_validator = RegexValidator(
    SLUG, "Use 1-50 lowercase letters, digits or hyphens, not starting or ending with a hyphen."
)
EXPERIMENT_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$")
experiment_name_validator = RegexValidator(
    EXPERIMENT_NAME,
    "Use 1-100 lowercase letters, digits, '.', '_' or '-', starting and ending with a letter "
    "or digit.",
)


def api_datetime(value: datetime | None) -> str | None:
    """A timestamp as the API writes it (DRF's format: ISO 8601, ``Z`` for UTC)."""
    if value is None:
        return None
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def dvbench_int(name: str) -> int:
    """An integer knob from ``settings.DVBENCH`` (validated when settings load)."""
    knobs: Mapping[str, object] = settings.DVBENCH
    value = knobs[name]
    assert isinstance(value, int), f"DVBENCH[{name!r}] must be an integer"
    return value


#: The schema tag inside every canonical spec document; bump it if the document changes.
SPEC_SCHEMA = "dvbench.spec/v1"


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
    #: The key the challenge seeds of this organisation's proofs derive from
    #: (``attestations.replay.draw``): hex, made on first use, never shown.
    challenge_key = models.CharField(max_length=64, blank=True, editable=False)

    class Meta:
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
        constraints = [
            models.UniqueConstraint(fields=["user", "organization"], name="one_role_per_org")
        ]
        ordering = ["organization__slug", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} {self.role} in {self.organization}"

    def clean(self) -> None:
        """Model validation (the Django admin's path): the role and lab/agency rules."""
        from django.core.exceptions import ValidationError

        from attestations.core.errors import DVBenchError

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
        from attestations.accounts.errors import InvitationRequiredError

        _not_an_agency(organization)
        with transaction.atomic():
            check_role(organization, user, role, joining=False)
            membership = (
                cls.objects.select_for_update().filter(organization=organization, user=user).first()
            )
            if membership is None:
                raise InvitationRequiredError(
                    f"{user.get_username()} is not a member of {organization.slug}: invite "
                    f"them (POST /api/v1/organizations/{organization.slug}/invitations/); "
                    "they join when they accept",
                    field="username",
                    detail={"username": user.get_username()},
                )
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
        from attestations.accounts.errors import AlreadyMemberError

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


def check_role(organization: Organization, user: User, role: str, *, joining: bool = True) -> None:
    """Refuse a role the organisation's kind forbids, or a user on both sides of the line.

    Raises:
        RoleNotAllowedError: a regulator in a lab, or anything but a regulator in an agency.
        RegulatorConflictError: a regulator joining a lab, or a lab member an agency.
    """
    from attestations.accounts.errors import RegulatorConflictError, RoleNotAllowedError

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
    from attestations.accounts.errors import AgencyMembersError

    if organization.is_agency:
        raise AgencyMembersError(
            f"{organization.slug} is an agency: its members are regulators, whom only the "
            "platform's operator appoints (manage.py agency grant)",
            field="username",
        )


def _keep_an_admin(organization: Organization, *, leaving: Membership) -> None:
    """Refuse to demote or remove a lab's last admin (the lab could never be managed again)."""
    from attestations.accounts.errors import LastAdminError

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
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="invitations"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="invitations"
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
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "user"],
                condition=Q(status="pending"),
                name="one_pending_invitation",
            )
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"invitation of {self.user} to {self.organization} as {self.role} ({self.status})"

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
        user: User,
        role: str,
        *,
        actor: User,
        ip: str | None = None,
    ) -> tuple[Invitation, bool]:
        """Invite ``user`` to a lab with ``role``, or change the role a pending one offers.

        Returns:
            The invitation and whether it is new.

        Raises:
            RoleNotAllowedError, RegulatorConflictError: see :func:`check_role`.
            AlreadyMemberError: ``user`` is a member already (change their role instead).
        """
        from attestations.accounts.errors import AlreadyMemberError

        ttl = timedelta(days=dvbench_int("INVITATION_TTL_DAYS"))
        _not_an_agency(organization)
        with transaction.atomic():
            check_role(organization, user, role)
            if Membership.objects.filter(organization=organization, user=user).exists():
                raise AlreadyMemberError(
                    f"{user.get_username()} is already a member of {organization.slug}; "
                    f"change their role with POST /api/v1/organizations/{organization.slug}"
                    "/members/",
                    field="username",
                )
            now = timezone.now()
            cls.objects.filter(
                organization=organization,
                user=user,
                status=InvitationStatus.PENDING,
                expires__lte=now,
            ).update(status=InvitationStatus.EXPIRED)
            invitation = (
                cls.objects.select_for_update()
                .filter(organization=organization, user=user, status=InvitationStatus.PENDING)
                .first()
            )
            created = invitation is None
            if invitation is None:
                invitation = cls.objects.create(
                    organization=organization,
                    user=user,
                    role=role,
                    invited_by=actor,
                    expires=now + ttl,
                )
            else:
                invitation.role, invitation.invited_by = role, actor
                invitation.expires = now + ttl
                invitation.save(update_fields=["role", "invited_by", "expires"])
            AuditEvent.record(
                "invitation.created" if created else "invitation.changed",
                actor=actor,
                organization=organization,
                target=invitation,
                detail={"username": user.get_username(), "role": role},
                ip=ip,
            )
        return invitation, created

    def _respond(self, status: str, *, actor: User | None, ip: str | None) -> None:
        from attestations.accounts.errors import InvitationClosedError

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
            detail={"username": self.user.get_username(), "role": self.role},
            ip=ip,
        )

    def accept(self, *, ip: str | None = None) -> Membership:
        """The invitee joins with the offered role (the rules are checked again now)."""
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
        # order_by(): the model's default ordering would join two tables for nothing.
        rows = Membership.objects.filter(user=user).order_by()
        roles: dict[int, str] = {}
        regulator = False
        for org, role, kind in rows.values_list("organization_id", "role", "organization__kind"):
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
        if self.superuser or (capability == Capability.READ and self.read_all):
            return Q()
        ids = [org for org, role in self.roles.items() if capability in ROLE_CAPABILITIES[role]]
        return Q(**{f"{field}__in": ids})

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

        Records ``api_key.created`` in the audit trail.
        """
        ttl = days if days is not None else dvbench_int("API_KEY_TTL_DAYS")
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


# --- Experiments and specs --------------------------------------------------------------


class Framework(models.TextChoices):
    JAX = "jax", "JAX"
    TORCH = "torch", "PyTorch"


class Regime(models.TextChoices):
    PRETRAINING = "pretraining", "Pre-training"
    CONTINUED_PRETRAINING = "continued-pretraining", "Continued pre-training"
    FINE_TUNING = "fine-tuning", "Supervised fine-tuning"
    RL = "rl", "Reinforcement learning"
    DISTILLATION = "distillation", "Distillation"


def canonical_json(document: Any) -> bytes:
    """The canonical encoding hashed into spec digests.

    UTF-8 JSON with keys sorted, no insignificant whitespace (``separators=(",", ":")``)
    and non-ASCII characters kept as they are. Integers are written exactly; the only
    non-integer number (GPU-hours) is written as a decimal string so no float formatting
    enters the digest.
    """
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


class ExperimentQuerySet(models.QuerySet["Experiment"]):
    def visible_to(self, access: Access) -> ExperimentQuerySet:
        return self.filter(access.orgs(Capability.READ, "owner_id"))

    def with_summary(self) -> ExperimentQuerySet:
        """What an experiment's representation reads; see :meth:`Experiment.summarize`."""
        return self.select_related("owner", "current_spec", "created_by")

    def by_full_name(self, full_name: str) -> ExperimentQuerySet:
        owner, _, name = full_name.partition("/")
        return self.filter(owner__slug=owner, name=name)


class Experiment(models.Model):
    """A training run registered in advance, identified as ``owner/name``."""

    owner = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="experiments")
    name = models.CharField(max_length=100, validators=[experiment_name_validator])
    current_spec = models.ForeignKey(
        "ExperimentSpec", on_delete=models.PROTECT, null=True, related_name="+"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    objects: ClassVar[ExperimentQuerySet] = ExperimentQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="experiment_name_per_owner")
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return self.full_name

    @property
    def full_name(self) -> str:
        return f"{self.owner.slug}/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        """The API representation, built directly (as healthchecks' ``Check.to_dict``).

        ``ExperimentSerializer`` validates input and documents this shape in the OpenAPI
        schema; building the output here is several times cheaper on a list page, and a
        test keeps the two identical.
        """
        spec = self.current_spec
        assert spec is not None
        return {
            "id": self.full_name,
            "owner": self.owner.slug,
            "name": self.name,
            "spec_digest": spec.digest,
            "spec": spec.to_dict(frozen=getattr(self, "spec_frozen", None)),
            "created": api_datetime(self.created),
            "created_by": self.created_by.get_username() if self.created_by else None,
            "proofs": self.proof_counts(),
        }

    @staticmethod
    def summarize(experiments: Iterable[Experiment]) -> None:
        """Attach proof counts and the current spec's frozen flag to many experiments.

        One grouped query for a whole page (proofs by experiment, status and spec),
        instead of two per experiment; a spec is frozen when some proof names it.
        """
        rows = {experiment.pk: experiment for experiment in experiments}
        if not rows:
            return
        for experiment in rows.values():
            experiment._counts = {}  # type: ignore[attr-defined]
            experiment.spec_frozen = False  # type: ignore[attr-defined]
        grouped = (
            Proof.objects.filter(experiment_id__in=rows)
            .order_by()
            .values_list("experiment_id", "status", "spec_id")
            .annotate(n=models.Count("id"))
        )
        for experiment_id, status, spec_id, n in grouped:
            experiment = rows[experiment_id]
            counts = experiment._counts  # type: ignore[attr-defined]
            counts[status] = counts.get(status, 0) + n
            if spec_id == experiment.current_spec_id:
                experiment.spec_frozen = True  # type: ignore[attr-defined]

    def proof_counts(self) -> dict[str, int]:
        """Proofs by status (attached by :meth:`summarize`, else one query)."""
        known = getattr(self, "_counts", None)
        if known is not None:
            return {status: known[status] for status in ProofStatus.values if known.get(status)}
        counts: dict[str, int] = {}
        for status in self.proofs.values_list("status", flat=True):
            counts[status] = counts.get(status, 0) + 1
        return counts

    @property
    def organization_id(self) -> int:
        return self.owner_id

    @classmethod
    @transaction.atomic
    def register(
        cls,
        owner: Organization,
        name: str,
        spec: Mapping[str, Any],
        *,
        user: User | None,
        ip: str | None = None,
    ) -> Experiment:
        """Create the experiment and its first spec version; records the registration."""
        experiment = cls.objects.create(owner=owner, name=name, created_by=user)
        first = ExperimentSpec.create_version(experiment, 1, spec)
        experiment.current_spec = first
        experiment.save(update_fields=["current_spec"])
        AuditEvent.record(
            "experiment.registered",
            actor=user,
            organization=owner,
            target=experiment,
            detail={
                "experiment": experiment.full_name,
                "spec_version": 1,
                "spec_digest": first.digest,
            },
            ip=ip,
        )
        return experiment

    @transaction.atomic
    def revise_spec(
        self, spec: Mapping[str, Any], *, user: User | None = None, ip: str | None = None
    ) -> tuple[ExperimentSpec, bool]:
        """Apply a changed spec.

        A spec with no proof attached is edited in place; a frozen one (a proof names it)
        is kept as it is and the change becomes a new version. An identical spec changes
        nothing. A change is recorded as ``experiment.spec_edited`` or
        ``experiment.spec_versioned``.

        Returns:
            The current spec and whether anything changed.
        """
        spec_row, changed, versioned = self._revise(spec)
        if changed:
            AuditEvent.record(
                "experiment.spec_versioned" if versioned else "experiment.spec_edited",
                actor=user,
                organization=self.owner,
                target=self,
                detail={
                    "experiment": self.full_name,
                    "spec_version": spec_row.version,
                    "spec_digest": spec_row.digest,
                },
                ip=ip,
            )
        return spec_row, changed

    def _revise(self, spec: Mapping[str, Any]) -> tuple[ExperimentSpec, bool, bool]:
        """(current spec, changed, whether the change made a new version)."""
        assert self.current_spec_id is not None, "an experiment always has a spec"
        current = ExperimentSpec.objects.select_for_update().get(pk=self.current_spec_id)
        fields = ExperimentSpec.fields_from(spec)
        if all(getattr(current, key) == value for key, value in fields.items()):
            return current, False, False
        if current.is_frozen:
            latest = self.specs.aggregate(models.Max("version"))["version__max"] or 0
            new = ExperimentSpec.create_version(self, latest + 1, spec)
            self.current_spec = new
            self.save(update_fields=["current_spec"])
            return new, True, True
        for key, value in fields.items():
            setattr(current, key, value)
        current.digest = current.compute_digest()
        current.save()
        return current, True, False


class ExperimentSpec(models.Model):
    """One version of an experiment's declared spec; frozen once a proof names it."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="specs")
    version = models.PositiveIntegerField()
    framework = models.CharField(max_length=8, choices=Framework.choices)
    model_description = models.TextField(max_length=2000)
    optimizer = models.CharField(max_length=500)
    dataset_commitment = models.CharField(max_length=64, validators=[sha256_validator])
    max_flops = models.DecimalField(max_digits=40, decimal_places=0, null=True, blank=True)
    max_tokens = models.DecimalField(max_digits=30, decimal_places=0, null=True, blank=True)
    max_gpu_hours = models.DecimalField(max_digits=14, decimal_places=3, null=True, blank=True)
    allowed_regimes = models.JSONField(default=list)
    digest = models.CharField(max_length=64, db_index=True)
    created = models.DateTimeField(default=timezone.now)

    SPEC_FIELDS: ClassVar[tuple[str, ...]] = (
        "framework",
        "model_description",
        "optimizer",
        "dataset_commitment",
        "max_flops",
        "max_tokens",
        "max_gpu_hours",
        "allowed_regimes",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["experiment", "version"], name="spec_version_unique")
        ]
        ordering = ["-version"]

    def __str__(self) -> str:
        return f"{self.experiment_id} v{self.version}"

    @classmethod
    def fields_from(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        fields = {key: spec.get(key) for key in cls.SPEC_FIELDS}
        fields["allowed_regimes"] = sorted(set(fields["allowed_regimes"] or []))
        for key in ("max_flops", "max_tokens", "max_gpu_hours"):
            if fields[key] is not None:
                fields[key] = Decimal(str(fields[key]))
        return fields

    @classmethod
    def create_version(
        cls, experiment: Experiment, version: int, spec: Mapping[str, Any]
    ) -> ExperimentSpec:
        row = cls(experiment=experiment, version=version, **cls.fields_from(spec))
        row.digest = row.compute_digest()
        row.save()
        return row

    def canonical_document(self) -> dict[str, Any]:
        """The document whose canonical JSON (:func:`canonical_json`) is hashed.

        It binds the experiment id, so the same limits declared for two experiments have
        two digests, and a transcript naming one cannot be filed under the other.
        """

        def integer(value: Decimal | None) -> int | None:
            return None if value is None else int(value)

        return {
            "schema": SPEC_SCHEMA,
            "experiment": self.experiment.full_name,
            "framework": self.framework,
            "model": self.model_description,
            "optimizer": self.optimizer,
            "dataset_commitment": self.dataset_commitment,
            "limits": {
                "max_flops": integer(self.max_flops),
                "max_tokens": integer(self.max_tokens),
                "max_gpu_hours": None
                if self.max_gpu_hours is None
                else format(Decimal(self.max_gpu_hours).normalize(), "f"),
                "allowed_regimes": sorted(self.allowed_regimes),
            },
        }

    def compute_digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of :meth:`canonical_document`."""
        return hashlib.sha256(canonical_json(self.canonical_document())).hexdigest()

    @property
    def is_frozen(self) -> bool:
        known = getattr(self, "_frozen", None)  # set from an annotated experiment row
        return bool(known) if known is not None else self.proofs.exists()

    def to_dict(self, *, frozen: bool | None = None) -> dict[str, Any]:
        """The API representation (``SpecSerializer``'s output, built directly)."""
        return {
            "version": self.version,
            "digest": self.digest,
            "frozen": self.is_frozen if frozen is None else frozen,
            "framework": self.framework,
            "model_description": self.model_description,
            "optimizer": self.optimizer,
            "dataset_commitment": self.dataset_commitment,
            "max_flops": None if self.max_flops is None else int(self.max_flops),
            "max_tokens": None if self.max_tokens is None else int(self.max_tokens),
            "max_gpu_hours": None if self.max_gpu_hours is None else float(self.max_gpu_hours),
            "allowed_regimes": list(self.allowed_regimes),
            "created": api_datetime(self.created),
        }


# --- Blobs and uploads ------------------------------------------------------------------


class Blob(models.Model):
    """Bytes stored once under their content address, whoever uploaded them."""

    sha256 = models.CharField(max_length=64, unique=True, validators=[sha256_validator])
    size = models.PositiveBigIntegerField()
    storage_name = models.CharField(max_length=255)
    created = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"sha256:{self.sha256}"

    @staticmethod
    def address(sha256: str) -> str:
        """The storage name of a blob: fanned out so no directory holds millions of files."""
        return f"blobs/sha256/{sha256[:2]}/{sha256[2:4]}/{sha256}"


class ArtifactKind(models.TextChoices):
    TRANSCRIPT = "transcript", "Transcript"
    ARTIFACT = "artifact", "Program artifact"
    SNAPSHOT = "snapshot", "State snapshot"
    BATCH = "batch", "Batch"


class UploadStatus(models.TextChoices):
    OPEN = "open", "Open"
    COMPLETING = "completing", "Completing"
    COMPLETE = "complete", "Complete"
    ABORTED = "aborted", "Aborted"
    FAILED = "failed", "Failed"


class Upload(models.Model):
    """A resumable multipart upload session; see ``attestations/uploads.py``."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="uploads")
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    #: The file's path in the proof directory, as the client names it (informational).
    name = models.CharField(max_length=255, blank=True)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    status = models.CharField(
        max_length=16, choices=UploadStatus.choices, default=UploadStatus.OPEN
    )
    reason = models.CharField(max_length=64, blank=True)
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, null=True, related_name="uploads")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    completed = models.DateTimeField(null=True, blank=True)
    #: A transcript already filed for the experiment: completing this upload filed nothing
    #: new, and this is the proof it is (``uploads.file_proof``).
    duplicate_of = models.ForeignKey(
        "Proof", on_delete=models.SET_NULL, null=True, blank=True, related_name="refilings"
    )

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"upload {self.id} ({self.kind}, {self.status})"

    @property
    def filed_proof_id(self) -> int | None:
        """The proof this transcript upload filed, or the earlier one it duplicates."""
        try:
            return self.proof.pk
        except Proof.DoesNotExist:
            return self.duplicate_of_id

    @property
    def staging_prefix(self) -> str:
        return f"staging/uploads/{self.id}"

    def part_name(self, number: int) -> str:
        return f"{self.staging_prefix}/{number:05d}"

    @property
    def received_bytes(self) -> int:
        # Summed in Python so that a prefetched parts list costs no query.
        return sum(part.size for part in self.parts.all())


class UploadPart(models.Model):
    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="parts")
    number = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    storage_name = models.CharField(max_length=255)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["upload", "number"], name="part_number_unique")
        ]
        ordering = ["number"]

    def __str__(self) -> str:
        return f"part {self.number} of {self.upload_id}"


# --- Proofs and jobs --------------------------------------------------------------------


class ProofStatus(models.TextChoices):
    """Where a proof stands.

    ``pending`` and ``verifying`` cover ingest (the offline verifier); a transcript that
    passes it is ``challenged`` while the platform's challenges wait for answers and
    replays. ``valid``, ``rejected`` and ``error`` are final.
    """

    PENDING = "pending", "Pending"
    VERIFYING = "verifying", "Verifying"
    CHALLENGED = "challenged", "Challenged"
    VALID = "valid", "Valid"
    REJECTED = "rejected", "Rejected"
    ERROR = "error", "Verifier error"


#: The verdict on a transcript that commits no program while one is required.
NO_PROGRAM: tuple[str, str] = (
    "no_program",
    "the transcript commits no program artifact, so the platform cannot replay any step; "
    "record the run with zkdv.jax or zkdv.torch",
)


#: The reason of a proof whose transcript already has a challenge plan in its experiment.
DUPLICATE_TRANSCRIPT = "duplicate_transcript"

#: The name of the probe file among a proof's artifacts (``zkdv.records.PROBES_FILE``).
PROBES_ARTIFACT = "probes.bin"

#: The fewest seconds between two progress writes of an ingest job: a few a second.
INGEST_PROGRESS_INTERVAL = 0.25


class IngestProgress:
    """Record how far the verifier got (bytes of the transcript verified) on a job.

    Called by ``zkdv.verify.verify_transcript`` every few hundred records; writes at
    most one row update per ``INGEST_PROGRESS_INTERVAL`` seconds, only forward, and
    stops short of 1.0, which :meth:`Job.finish` writes with the verdict.
    """

    def __init__(self, job: Job | None, total: int) -> None:
        self.job_id = job.pk if job is not None else None
        self.total = total
        self.interval = INGEST_PROGRESS_INTERVAL
        self.fraction = 0.0
        self.written = float("-inf")

    def __call__(self, done: int) -> None:
        if self.job_id is None or self.total <= 0:
            return
        now = time.monotonic()
        fraction = min(0.99, done / self.total)
        if fraction <= self.fraction or now - self.written < self.interval:
            return
        self.fraction, self.written = fraction, now
        Job.objects.filter(pk=self.job_id, status=JobStatus.RUNNING).update(progress=fraction)


class Proof(models.Model):
    """A transcript filed against an experiment, and the verifier's verdict on it."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="proofs")
    spec = models.ForeignKey(ExperimentSpec, on_delete=models.PROTECT, related_name="proofs")
    transcript = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="proofs")
    upload = models.OneToOneField(
        Upload, on_delete=models.SET_NULL, null=True, blank=True, related_name="proof"
    )
    status = models.CharField(
        max_length=16, choices=ProofStatus.choices, default=ProofStatus.PENDING, db_index=True
    )
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    record_index = models.IntegerField(null=True, blank=True)
    field = models.CharField(max_length=200, blank=True)
    steps = models.PositiveIntegerField(default=0)
    checks = models.PositiveIntegerField(default=0)
    prover = models.CharField(max_length=32, blank=True)
    transcript_digest = models.CharField(max_length=128, blank=True)
    report = models.JSONField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    claimed = models.DateTimeField(null=True, blank=True)
    verified = models.DateTimeField(null=True, blank=True)
    # The challenge plan (attestations/replay.py). The seed is the platform's secret
    # until the verdict is final: only its SHA-256 is shown while answers are pending,
    # so the trainer cannot predict which steps a re-filed transcript would face.
    challenge_seed = models.CharField(max_length=64, blank=True)
    challenge_seed_commitment = models.CharField(max_length=64, blank=True)
    challenge_seed_revealed = models.DateTimeField(null=True, blank=True)
    challenge_target = models.FloatField(null=True, blank=True)
    challenge_forged_fraction = models.FloatField(null=True, blank=True)
    challenges_drawn = models.DateTimeField(null=True, blank=True)
    challenge_deadline = models.DateTimeField(null=True, blank=True)
    #: This proof's place among the experiment's proofs that were challenged (1, 2, ...):
    #: each later one is drawn against half the miss probability (docs/provers.md).
    challenge_filing = models.PositiveIntegerField(null=True, blank=True)
    #: SHA-256 over what the run computed (program, initial state, every step's batch and
    #: post-state roots): the same committed run always gets the same seed.
    challenge_run_digest = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created"]
        constraints = [
            # One challenge plan per transcript per experiment: filing the same transcript
            # again never draws again. (Plans drawn before filings were numbered carry no
            # index and are left as they are: a database may hold the duplicates that
            # this rule was written against, and they stay on the record.)
            models.UniqueConstraint(
                fields=["experiment", "transcript_digest"],
                condition=Q(challenge_filing__isnull=False),
                name="one_plan_per_transcript",
            ),
            models.UniqueConstraint(
                fields=["experiment", "challenge_filing"],
                condition=Q(challenge_filing__isnull=False),
                name="one_proof_per_filing_index",
            ),
        ]

    def __str__(self) -> str:
        return f"proof {self.pk} of {self.experiment_id} ({self.status})"

    @property
    def verdict_label(self) -> str:
        """The verdict as auditors read it: an unanswered challenge is an abandoned proof."""
        if self.status == ProofStatus.REJECTED and self.reason == "challenge_expired":
            return "abandoned"
        return str(self.status)

    @property
    def revealed_seed(self) -> str | None:
        """The challenge seed once it may be shown (the verdict is final), else None."""
        return self.challenge_seed if self.challenge_seed_revealed is not None else None

    @property
    def organization_id(self) -> int:
        return self.experiment.owner_id

    @property
    def is_final(self) -> bool:
        return self.status in {ProofStatus.VALID, ProofStatus.REJECTED, ProofStatus.ERROR}

    @property
    def is_duplicate(self) -> bool:
        """Rejected because the same transcript already has a plan in this experiment."""
        return self.status == ProofStatus.REJECTED and self.reason == DUPLICATE_TRANSCRIPT

    @classmethod
    def claim(cls, proof_id: int) -> bool:
        """Move a pending proof to ``verifying``; False if another worker owns it.

        A proof stuck in ``verifying`` longer than the task hard limit belonged to a
        worker that died, and may be claimed again.
        """
        now = timezone.now()
        stale = now - timedelta(seconds=int(getattr(settings, "CELERY_TASK_TIME_LIMIT", 3600)))
        return bool(
            cls.objects.filter(pk=proof_id)
            .filter(
                Q(status=ProofStatus.PENDING) | Q(status=ProofStatus.VERIFYING, claimed__lt=stale)
            )
            .update(status=ProofStatus.VERIFYING, claimed=now)
        )

    def check_identity(self, root: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
        """Check the transcript's root names this experiment and one of its spec versions.

        Returns:
            None when it does, else ``(reason, message, field)``.
        """
        named = root.get("experiment") if isinstance(root, Mapping) else None
        if not isinstance(named, Mapping):
            return (
                "experiment_missing",
                f"the transcript names no experiment; expected {self.experiment.full_name}",
                "root.experiment",
            )
        name, digest = named.get("name"), named.get("spec_digest")
        if name != self.experiment.full_name:
            return (
                "experiment_mismatch",
                f"the transcript names experiment {name!r}; expected {self.experiment.full_name!r}",
                "root.experiment.name",
            )
        spec = self.experiment.specs.filter(digest=digest).first()
        if spec is None:
            return (
                "spec_mismatch",
                f"the transcript names spec digest {digest!r}, which is no version of "
                f"{self.experiment.full_name} (current: {self.experiment.current_spec.digest})",  # type: ignore[union-attr]
                "root.experiment.spec_digest",
            )
        prover = root.get("prover") if isinstance(root, Mapping) else None
        expected = f"whitebox-{spec.framework}"
        if prover != expected:
            return (
                "framework_mismatch",
                f"the transcript was made by prover {prover!r}; spec version {spec.version} "
                f"declares framework {spec.framework!r}, so expected {expected!r}",
                "root.prover",
            )
        return None

    def verify(self) -> None:
        """Run the offline verifier on the stored transcript and record the verdict.

        Called by the ingest task after :meth:`claim`. Bad transcript data is a verdict
        (``rejected`` with the verifier's reason), never an exception; an unusable
        verifier is recorded as ``error``.
        """
        job = self.jobs.order_by("-created").first()
        if job is not None:
            job.start()
        try:
            from zkdv.verify import verify_transcript
        except ImportError as error:
            with transaction.atomic():
                self._record(ProofStatus.ERROR, "verifier_unavailable", f"{error}")
                if job is not None:
                    job.finish(JobStatus.FAILED, "verifier_unavailable")
            return
        from django.core.files.storage import default_storage

        progress = IngestProgress(job, self.transcript.size)
        try:
            with (
                default_storage.open(self.transcript.storage_name, "rb") as handle,
                self._probes_file() as probes,
            ):
                report = verify_transcript(handle, probes_path=probes, on_progress=progress)
        except Exception as error:
            # Not the transcript's fault (the verifier never raises for bad data): record
            # it where users see it rather than leave the proof "verifying" for ever.
            log.exception("verifying proof %s failed", self.pk)
            with transaction.atomic():
                self._record(
                    ProofStatus.ERROR, "verifier_failed", f"{type(error).__name__}: {error}"
                )
                if job is not None:
                    job.finish(JobStatus.FAILED, "verifier_failed")
            return
        # The verdict, its audit event, the challenges and the job's end are one
        # transaction: a database lost between them (a restart mid-ingest) must not leave
        # a final proof whose job runs for ever, or a verdict without its audit event;
        # the task's retry then finds the proof to verify again.
        with transaction.atomic():
            self.report = report.to_dict()
            self.steps = report.steps
            self.checks = report.checks
            self.transcript_digest = report.digest or ""
            root = report.root if isinstance(report.root, Mapping) else None
            self.prover = str(root.get("prover", "")) if root else ""
            if not report.ok:
                self._record(
                    ProofStatus.REJECTED,
                    report.reason or "rejected",
                    report.message or "",
                    record=report.record,
                    field=report.field or "",
                )
            elif (mismatch := self.check_identity(root)) is not None:
                self._record(
                    ProofStatus.REJECTED, mismatch[0], mismatch[1], record=0, field=mismatch[2]
                )
            else:
                named = root["experiment"]  # type: ignore[index]
                self.spec = self.experiment.specs.get(digest=named["spec_digest"])
                from attestations import replay

                if replay.replayable(root):
                    # The transcript is consistent; now the platform stops trusting the
                    # trainer: its challenges decide the verdict (attestations/replay.py).
                    replay.draw(self)
                elif settings.DVBENCH.get("REQUIRE_PROGRAM", True):
                    # Without a program no step can be replayed, so accepting it would let a
                    # forger escape every challenge just by leaving the program out.
                    self._record(ProofStatus.REJECTED, *NO_PROGRAM, record=0, field="root.program")
                else:
                    # Opted out (DVBENCH_REQUIRE_PROGRAM=false): the offline verdict stands.
                    self._record(ProofStatus.VALID, "", "")
            if job is not None:
                job.finish(JobStatus.SUCCEEDED, self.reason)
            if self.status in {ProofStatus.VALID, ProofStatus.REJECTED} and not self.is_duplicate:
                # Final at ingest (no challenges to wait for): certify it now, as
                # ``replay.settle`` does after the last challenge. A duplicate is certified
                # by the proof it repeats.
                self._certify_on_commit()

    def _certify_on_commit(self) -> None:
        from attestations.certificate_tasks import issue_certificate

        proof_id = self.pk
        transaction.on_commit(lambda: issue_certificate.delay(proof_id))

    @contextmanager
    def _probes_file(self) -> Iterator[str | None]:
        """A local copy of the attached ``probes.bin``, if any, for the verifier to check.

        The SDK attaches it after filing the transcript, so at a first ingest it is
        usually absent and the first replay checks it (``replay.check_probes``); when it
        is here (a re-ingest), every probe is checked against the transcript's digests.
        """
        from django.core.files.storage import default_storage

        artifact = self.artifacts.filter(name=PROBES_ARTIFACT).select_related("blob").first()
        if artifact is None:
            yield None
            return
        with tempfile.TemporaryDirectory(prefix="dvbench-probes-") as scratch:
            path = f"{scratch}/{PROBES_ARTIFACT}"
            with (
                default_storage.open(artifact.blob.storage_name, "rb") as source,
                open(path, "wb") as target,
            ):
                shutil.copyfileobj(source, target, 1024 * 1024)
            yield path

    def _record(
        self, status: str, reason: str, message: str, *, record: int | None = None, field: str = ""
    ) -> None:
        self.status = status
        self.reason = reason[:64]
        self.message = message
        self.record_index = record
        self.field = field[:200]
        self.verified = timezone.now()
        self.save()
        AuditEvent.record(
            f"proof.{status}",
            organization=self.experiment.owner,
            target=self,
            detail={
                "experiment": self.experiment.full_name,
                "reason": reason or None,
                "record": record,
                "steps": self.steps,
                "checks": self.checks,
            },
        )


class ProofArtifact(models.Model):
    """A file of a proof directory the trainer attached: a stored blob under its name.

    ``name`` is the path relative to the proof directory (``snapshots/00000004/p.bin``),
    the same on the trainer's disk and in the directory a replay worker materialises.
    """

    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=255)
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="artifacts")
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    size = models.PositiveBigIntegerField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["proof", "name"], name="proof_artifact_name_unique")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} of proof {self.proof_id}"


class ChallengeOrigin(models.TextChoices):
    GENESIS = "genesis", "Genesis (step 0)"
    SELF_CHECKED = "self_checked", "Self-checked by the trainer"
    RANDOM = "random", "Random"
    WINDOW = "window", "Window"


class ChallengeStatus(models.TextChoices):
    """A challenge's life: answered (``ready``), replayed, and a final verdict."""

    PENDING = "pending", "Awaiting files"
    READY = "ready", "Ready to replay"
    REPLAYING = "replaying", "Replaying"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"
    ERROR = "error", "Replay error"


#: Challenge states that no longer change.
CHALLENGE_FINAL = frozenset(
    {ChallengeStatus.PASSED, ChallengeStatus.FAILED, ChallengeStatus.EXPIRED, ChallengeStatus.ERROR}
)


class Challenge(models.Model):
    """One step (or window, up to ``through``) of a proof the platform replays."""

    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, related_name="challenges")
    step = models.PositiveIntegerField()
    through = models.PositiveIntegerField(null=True, blank=True)
    origin = models.CharField(max_length=16, choices=ChallengeOrigin.choices)
    status = models.CharField(
        max_length=16,
        choices=ChallengeStatus.choices,
        default=ChallengeStatus.PENDING,
        db_index=True,
    )
    #: Proof-directory names the replay reads (snapshot files, batch files).
    needed_files = models.JSONField(default=list)
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    evidence = models.JSONField(null=True, blank=True)
    steps_total = models.PositiveIntegerField(default=0)
    steps_replayed = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    answered = models.DateTimeField(null=True, blank=True)
    claimed = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["proof", "step", "through"],
                name="challenge_step_unique",
                nulls_distinct=False,
            )
        ]
        ordering = ["step", "through"]

    def __str__(self) -> str:
        span = f"{self.step}..{self.through}" if self.through is not None else f"{self.step}"
        return f"challenge {span} of proof {self.proof_id} ({self.status})"

    @property
    def is_final(self) -> bool:
        return self.status in CHALLENGE_FINAL


class JobStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class Job(models.Model):
    """A background task as users see it: what it is for, how far it got, how it ended."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=32)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, null=True, related_name="jobs")
    status = models.CharField(
        max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True
    )
    progress = models.FloatField(default=0.0)
    # Replay jobs count steps: ``progress`` is ``steps_done / steps_total``.
    steps_done = models.PositiveIntegerField(default=0)
    steps_total = models.PositiveIntegerField(default=0)
    reason = models.CharField(max_length=64, blank=True)
    task_id = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.kind} job {self.id} ({self.status})"

    def start(self) -> None:
        Job.objects.filter(pk=self.pk).update(
            status=JobStatus.RUNNING, started=timezone.now(), progress=0.0
        )

    def finish(self, status: str, reason: str = "") -> None:
        self.status, self.reason, self.progress = status, reason[:64], 1.0
        self.finished = timezone.now()
        self.save(update_fields=["status", "reason", "progress", "finished"])


# --- Audit trail ------------------------------------------------------------------------


class AppendOnlyError(Exception):
    """Raised on an attempt to change or delete an audit event."""


class AuditEventQuerySet(models.QuerySet["AuditEvent"]):
    def update(self, **kwargs: Any) -> int:
        raise AppendOnlyError("audit events are append-only; they cannot be updated")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("audit events are append-only; they cannot be deleted")


class AuditEvent(models.Model):
    """Who did what, when, from where. Rows are only ever inserted."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)
    organization = models.ForeignKey(
        Organization, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    detail = models.JSONField(default=dict)
    ip = models.GenericIPAddressField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)

    objects: ClassVar[AuditEventQuerySet] = AuditEventQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.created:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnlyError("audit events are append-only; they cannot be updated")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("audit events are append-only; they cannot be deleted")

    @classmethod
    def record(
        cls,
        action: str,
        *,
        actor: User | AnonymousUser | None = None,
        organization: Organization | None = None,
        target: models.Model | None = None,
        detail: Mapping[str, Any] | None = None,
        ip: str | None = None,
    ) -> AuditEvent:
        user = actor if isinstance(actor, User) else None
        return cls.objects.create(
            actor=user,
            actor_name=user.get_username() if user is not None else "",
            organization=organization,
            action=action,
            target_type=target._meta.model_name or "" if target is not None else "",
            target_id=str(target.pk) if target is not None else "",
            detail=dict(detail or {}),
            ip=ip,
        )


def client_ip(meta: Mapping[str, Any]) -> str | None:
    """The peer address of a request (``REMOTE_ADDR``; proxies are configured upstream)."""
    value = meta.get("REMOTE_ADDR")
    return str(value) if value else None


__all__ = [
    "Access",
    "ApiKey",
    "AppendOnlyError",
    "ArtifactKind",
    "AuditEvent",
    "Blob",
    "Capability",
    "Challenge",
    "ChallengeOrigin",
    "ChallengeStatus",
    "Experiment",
    "ExperimentSpec",
    "Framework",
    "Invitation",
    "InvitationStatus",
    "Job",
    "JobStatus",
    "Membership",
    "Organization",
    "OrganizationKind",
    "Proof",
    "ProofArtifact",
    "ProofStatus",
    "Regime",
    "Role",
    "Upload",
    "UploadPart",
    "UploadStatus",
    "WorkerHeartbeat",
]


class WorkerHeartbeat(models.Model):
    """A row written by a Celery worker: proof that the broker and worker round-trip works."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"heartbeat {self.token} from {self.hostname}"


# Certificates, signing keys and the transparency log live in their own module; importing
# it here registers those models with this app.
from attestations.certificate_models import *  # noqa: E402, F403
