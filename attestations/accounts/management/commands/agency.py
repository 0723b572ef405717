"""``manage.py agency``: the operator's path to regulators.

A regulator reads the claims and certificates of every organisation, so the role comes
only from whoever operates the platform: a regulator is a member of an *agency*, an
organisation the operator created and marked as such, and nobody else can make either.
Lab admins cannot grant the role (the API and the web UI do not offer it), and no lab
member can hold it (a regulator belongs to no lab).

    manage.py agency create eu-ai-office --name "EU AI Office"
    manage.py agency grant eu-ai-office alice       # alice becomes a regulator
    manage.py agency revoke eu-ai-office alice
    manage.py agency list                           # agencies, their regulators, and
                                                    # regulator roles held outside them

Every change is in the audit trail (actor: the operator, ``--actor``, default none).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from attestations.accounts.models import Membership, Organization, OrganizationKind, Role
from attestations.audit.models import AuditEvent
from attestations.core.errors import DVBenchError
from attestations.core.validators import slug_validator


def create_agency(slug: str, name: str, *, actor: Any = None) -> tuple[Organization, bool]:
    """Create the agency ``slug``, or mark an existing organisation as one.

    An existing organisation becomes an agency only if it holds nothing an agency cannot:
    members other than regulators, or experiments.

    Returns:
        The agency and whether it was created or changed.

    Raises:
        CommandError: the slug is not valid, or the organisation cannot become an agency.
    """
    try:
        slug_validator(slug)
    except ValidationError as error:
        raise CommandError(f"{slug!r}: {' '.join(error.messages)}") from None
    with transaction.atomic():
        organization = Organization.objects.select_for_update().filter(slug=slug).first()
        if organization is not None and organization.is_agency:
            return organization, False
        created = organization is None
        if organization is None:
            organization = Organization.objects.create(
                slug=slug, name=name or slug, kind=OrganizationKind.AGENCY
            )
        else:
            organization.kind = OrganizationKind.AGENCY
            try:
                organization.clean()
            except ValidationError as error:
                raise CommandError(" ".join(error.messages)) from None
            organization.save(update_fields=["kind"])
        AuditEvent.record(
            "organization.agency_created" if created else "organization.made_agency",
            actor=actor,
            organization=organization,
            target=organization,
            detail={"slug": organization.slug, "name": organization.name},
        )
    return organization, True


def grant_regulator(slug: str, username: str, *, actor: Any = None) -> Membership:
    """Make ``username`` a regulator in the agency ``slug`` (the operator's act).

    Raises:
        CommandError: no such agency or user, or the user is a member of a lab.
    """
    agency = Organization.objects.filter(slug=slug, kind=OrganizationKind.AGENCY).first()
    if agency is None:
        raise CommandError(f"no agency {slug!r} (create it with: manage.py agency create)")
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None:
        raise CommandError(f"no active user {username!r}")
    existing = Membership.objects.filter(organization=agency, user=user).first()
    if existing is not None:
        return existing
    try:
        return Membership.join(
            agency, user, Role.REGULATOR, actor=actor, detail={"granted_by": "operator"}
        )
    except DVBenchError as error:
        raise CommandError(error.message) from None


class Command(BaseCommand):
    help = "Create agencies and grant or revoke the regulator role (the operator's path)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create an agency (or mark an organisation)")
        create.add_argument("slug")
        create.add_argument("--name", default="", help="display name (default: the slug)")
        grant = sub.add_parser("grant", help="make a user a regulator in an agency")
        grant.add_argument("slug")
        grant.add_argument("username")
        revoke = sub.add_parser("revoke", help="remove a regulator from an agency")
        revoke.add_argument("slug")
        revoke.add_argument("username")
        sub.add_parser("list", help="agencies, their regulators, and misplaced roles")
        for each in (create, grant, revoke):
            each.add_argument("--actor", default="", help="the operator's username, if any")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if action == "list":
            self._list()
            return
        actor = None
        if options.get("actor"):
            actor = get_user_model().objects.filter(username=options["actor"]).first()
            if actor is None:
                raise CommandError(f"no user {options['actor']!r} (--actor)")
        if action == "create":
            agency, changed = create_agency(options["slug"], options["name"], actor=actor)
            self.stdout.write(
                f"agency {agency.slug} ({agency.name}) " + ("ready" if changed else "exists")
            )
        elif action == "grant":
            membership = grant_regulator(options["slug"], options["username"], actor=actor)
            self.stdout.write(
                f"{membership.user.get_username()} is a regulator in {membership.organization}"
            )
        elif action == "revoke":
            held = Membership.objects.filter(
                organization__slug=options["slug"],
                organization__kind=OrganizationKind.AGENCY,
                user__username=options["username"],
            ).first()
            if held is None:
                raise CommandError(
                    f"{options['username']!r} is not a regulator in {options['slug']!r}"
                )
            held.remove(actor=actor)
            self.stdout.write(f"{options['username']} is no longer a regulator")

    def _list(self) -> None:
        for agency in Organization.objects.filter(kind=OrganizationKind.AGENCY):
            names = sorted(agency.memberships.values_list("user__username", flat=True).order_by())
            self.stdout.write(f"{agency.slug}\t{agency.name}\t{', '.join(names) or '-'}")
        misplaced = Membership.objects.filter(role=Role.REGULATOR).exclude(
            organization__kind=OrganizationKind.AGENCY
        )
        for membership in misplaced.select_related("user", "organization"):
            # Left from before agencies existed: such a row reads its own lab only.
            self.stdout.write(
                f"warning: {membership.user.get_username()} holds the regulator role in the "
                f"lab {membership.organization.slug}, where it grants no cross-organisation "
                "reading; grant it in an agency instead and remove this membership",
                self.style.WARNING,
            )
