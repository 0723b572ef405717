"""What one user may do, computed once per request from their memberships (:class:`Access`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import connections, models, router
from django.db.models import Q

from attestations.accounts.models.memberships import Membership
from attestations.accounts.models.organizations import (
    ROLE_CAPABILITIES,
    Capability,
    Organization,
    OrganizationKind,
    Role,
)


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
