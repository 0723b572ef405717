"""Organisations and the roles their members hold.

A lab trains and files proofs; an agency holds regulators, who read every lab. What each
role may do inside its organisation is its capabilities (:data:`ROLE_CAPABILITIES`), and
which roles an organisation's members may hold depends on its kind.
"""

from __future__ import annotations

from collections.abc import Mapping

from django.db import models
from django.utils import timezone

from attestations.core.validators import slug_validator


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
