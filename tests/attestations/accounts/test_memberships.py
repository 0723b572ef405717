"""Who may join an organisation, with which role, and who decides.

* Cross-organisation reading (the regulator role) comes only from the operator: a
  regulator is a member of an agency that ``manage.py agency`` (or the Django admin)
  made. No lab admin can grant the role and no lab member can hold it.
* Nobody joins a lab without consenting: an admin invites, the user accepts.
* A lab keeps at least one admin.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from attestations.accounts.models import (
    Access,
    Invitation,
    Membership,
    Organization,
    OrganizationKind,
    Role,
)
from attestations.audit.models import AuditEvent
from tests.attestations.base import World, error_of, make_user

Api = Callable[[str | None], APIClient]


def _visible(client: APIClient) -> set[str]:
    return {e["id"] for e in client.get("/api/v1/experiments/").json()["results"]}


# --- the regulator role -------------------------------------------------------------------


def test_a_lab_admin_cannot_mint_a_regulator(world: World, api: Api) -> None:
    # The attack of the report: lab2's admin grants `regulator` to lab2's auditor, who
    # then reads every organisation. Here evil's admin tries it every way the API has.
    world.users["evil-admin"] = make_user("evil-admin")
    world.users["evil-auditor"] = make_user("evil-auditor")
    Membership.objects.create(user=world.users["evil-admin"], organization=world.evil, role="admin")
    Membership.objects.create(
        user=world.users["evil-auditor"], organization=world.evil, role="auditor"
    )
    admin = api("evil-admin")
    change = admin.post(
        "/api/v1/organizations/evil/members/",
        {"username": "evil-auditor", "role": "regulator"},
        format="json",
    )
    assert change.status_code == 400
    assert error_of(change)["field"] == "role"
    invite = admin.post(
        "/api/v1/organizations/evil/invitations/",
        {"username": "bob", "role": "regulator"},
        format="json",
    )
    assert invite.status_code == 400
    assert Membership.objects.get(user=world.users["evil-auditor"]).role == "auditor"
    assert not Invitation.objects.exists()
    assert "acme/run-1" not in _visible(api("evil-auditor"))
    assert api("evil-auditor").get(f"/api/v1/proofs/{world.proof.pk}/").status_code == 404


def test_a_regulator_row_in_a_lab_reads_only_that_lab(world: World, api: Api) -> None:
    # A "regulator" membership left in a lab from before agencies existed (or written by
    # hand) grants no cross-organisation reading: only an agency's does.
    Membership.objects.filter(user=world.mallory).update(role=Role.REGULATOR)
    access = Access.for_user(world.mallory)
    assert not access.read_all and not access.is_regulator
    assert _visible(api("mallory")) == {"evil/heist"}
    assert api("mallory").get("/api/v1/me/").json()["is_regulator"] is False
    assert api("carol").get("/api/v1/me/").json()["is_regulator"] is True
    assert _visible(api("carol")) == {"acme/run-1", "evil/heist"}


def test_the_operator_makes_agencies_and_regulators(world: World, api: Api) -> None:
    world.users["eve"] = make_user("eve")
    out = io.StringIO()
    call_command("agency", "create", "ofcom", "--name", "Ofcom", stdout=out)
    call_command("agency", "grant", "ofcom", "eve", "--actor", "admin", stdout=out)
    assert Organization.objects.get(slug="ofcom").kind == OrganizationKind.AGENCY
    assert Membership.objects.get(user=world.users["eve"]).role == Role.REGULATOR
    assert _visible(api("eve")) == {"acme/run-1", "evil/heist"}
    # Claims, never artifacts.
    assert api("eve").get(f"/api/v1/proofs/{world.proof.pk}/transcript/").status_code == 403
    granted = AuditEvent.objects.get(action="membership.added", organization__slug="ofcom")
    assert granted.actor_name == "admin" and granted.detail["granted_by"] == "operator"
    call_command("agency", "revoke", "ofcom", "eve", stdout=out)
    assert api("eve").get("/api/v1/experiments/").status_code == 403  # in no organisation
    assert api("eve").get(f"/api/v1/proofs/{world.proof.pk}/").status_code == 403
    listed = io.StringIO()
    call_command("agency", "list", stdout=listed)
    assert "eu-office" in listed.getvalue() and "carol" in listed.getvalue()


def test_no_lab_member_can_hold_the_regulator_role(world: World) -> None:
    with pytest.raises(CommandError, match="member of the lab acme"):
        call_command("agency", "grant", "eu-office", "alice", stdout=io.StringIO())
    assert not Membership.objects.filter(user=world.alice, role=Role.REGULATOR).exists()
    # Nor can a lab become an agency while it has lab members or experiments.
    with pytest.raises(CommandError, match="cannot hold"):
        call_command("agency", "create", "acme", stdout=io.StringIO())
    assert Organization.objects.get(slug="acme").kind == OrganizationKind.LAB
    # The Django admin's path (model validation) says the same.
    row = Membership(user=world.alice, organization=Organization.objects.get(slug="eu-office"))
    row.role = Role.REGULATOR
    with pytest.raises(ValidationError, match="member of the lab acme"):
        row.full_clean()
    lab_regulator = Membership(user=world.users["bob"], organization=world.evil, role="regulator")
    with pytest.raises(ValidationError, match="only in an agency"):
        lab_regulator.full_clean()


def test_a_regulator_cannot_join_a_lab(world: World, api: Api) -> None:
    # Answered as any invitation (the inviter learns nothing, issue 34), but carol never
    # sees it: it is to the name only.
    invite = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "carol", "role": "auditor"},
        format="json",
    )
    assert invite.status_code == 201
    assert Invitation.objects.get(pk=invite.json()["id"]).user is None
    assert api("carol").get("/api/v1/invitations/").json()["results"] == []
    accept = api("carol").post(f"/api/v1/invitations/{invite.json()['id']}/accept/")
    assert accept.status_code == 404
    assert not Membership.objects.filter(user=world.carol, organization=world.acme).exists()
    # An invitation offered before the user became a regulator cannot be accepted after.
    world.users["eve"] = make_user("eve")
    offered = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "eve", "role": "auditor"},
        format="json",
    )
    assert offered.status_code == 201
    call_command("agency", "grant", "eu-office", "eve", stdout=io.StringIO())
    accepted = api("eve").post(f"/api/v1/invitations/{offered.json()['id']}/accept/")
    assert accepted.status_code == 409
    assert error_of(accepted)["code"] == "regulator_conflict"
    assert not Membership.objects.filter(user=world.users["eve"], organization=world.acme).exists()
    assert Invitation.objects.get(pk=offered.json()["id"]).status == "pending"


# --- consent: invitations -----------------------------------------------------------------


def test_a_member_of_another_lab_is_invited_not_added(world: World, api: Api) -> None:
    # The report's second finding: lab2's admin added `trainer` (of demo) to lab2, and
    # trainer's key then read lab2's data, without trainer ever agreeing.
    direct = api("admin").post(
        "/api/v1/organizations/acme/members/",
        {"username": "mallory", "role": "trainer"},
        format="json",
    )
    assert direct.status_code == 409
    assert error_of(direct)["code"] == "invitation_required"
    invited = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "mallory", "role": "trainer"},
        format="json",
    )
    assert invited.status_code == 201, invited.content
    assert invited.json()["status"] == "pending"
    # Until mallory accepts, nothing of acme is hers.
    assert "acme/run-1" not in _visible(api("mallory"))
    mine = api("mallory").get("/api/v1/invitations/").json()["results"]
    assert [(i["organization"], i["role"]) for i in mine] == [("acme", "trainer")]
    # Re-inviting with another role changes the pending invitation (200), no duplicate.
    again = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "mallory", "role": "auditor"},
        format="json",
    )
    assert again.status_code == 200 and again.json()["id"] == invited.json()["id"]
    accepted = api("mallory").post(f"/api/v1/invitations/{invited.json()['id']}/accept/")
    assert accepted.status_code == 200, accepted.content
    assert accepted.json()["role"] == "auditor"
    assert "acme/run-1" in _visible(api("mallory"))
    # An answered invitation stays answered.
    twice = api("mallory").post(f"/api/v1/invitations/{invited.json()['id']}/accept/")
    assert twice.status_code == 409 and error_of(twice)["code"] == "invitation_closed"


def test_declined_and_revoked_invitations_give_nothing(world: World, api: Api) -> None:
    world.users["eve"] = make_user("eve")
    first = (
        api("admin")
        .post(
            "/api/v1/organizations/acme/invitations/",
            {"username": "eve", "role": "trainer"},
            format="json",
        )
        .json()
    )
    assert api("eve").post(f"/api/v1/invitations/{first['id']}/decline/").status_code == 200
    second = (
        api("admin")
        .post(
            "/api/v1/organizations/acme/invitations/",
            {"username": "eve", "role": "trainer"},
            format="json",
        )
        .json()
    )
    assert second["id"] != first["id"]
    revoke = api("admin").delete(f"/api/v1/organizations/acme/invitations/{second['id']}/")
    assert revoke.status_code == 204
    late = api("eve").post(f"/api/v1/invitations/{second['id']}/accept/")
    assert late.status_code == 409
    assert not Membership.objects.filter(user=world.users["eve"]).exists()
    statuses = set(Invitation.objects.values_list("status", flat=True))
    assert statuses == {"declined", "revoked"}


def test_an_expired_invitation_cannot_be_accepted(world: World, api: Api, settings: Any) -> None:
    from django.utils import timezone

    world.users["eve"] = make_user("eve")
    offered = (
        api("admin")
        .post(
            "/api/v1/organizations/acme/invitations/",
            {"username": "eve", "role": "trainer"},
            format="json",
        )
        .json()
    )
    Invitation.objects.filter(pk=offered["id"]).update(expires=timezone.now())
    assert api("eve").get("/api/v1/invitations/").json()["results"] == []
    response = api("eve").post(f"/api/v1/invitations/{offered['id']}/accept/")
    assert response.status_code == 409
    assert error_of(response)["detail"] == {"status": "expired"}


def test_an_unknown_user_is_invited_like_anyone_and_nobody_sees_it(world: World, api: Api) -> None:
    # Was a 404 unknown_user: a way to enumerate usernames (issue 34, finding 5).
    response = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "nobody", "role": "trainer"},
        format="json",
    )
    assert response.status_code == 201
    assert response.json()["username"] == "nobody" and response.json()["status"] == "pending"
    listed = api("admin").get("/api/v1/organizations/acme/invitations/").json()["results"]
    assert [i["username"] for i in listed] == ["nobody"]
    assert Invitation.objects.get(pk=response.json()["id"]).user is None
    # A malformed name is still refused, for its form alone.
    bad = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "no body", "role": "trainer"},
        format="json",
    )
    assert bad.status_code == 400 and error_of(bad)["field"] == "username"


# --- the last admin -----------------------------------------------------------------------


def test_the_last_admin_cannot_demote_or_remove_themselves(world: World, api: Api) -> None:
    admin = api("admin")
    demote = admin.post(
        "/api/v1/organizations/acme/members/",
        {"username": "admin", "role": "trainer"},
        format="json",
    )
    assert demote.status_code == 409
    assert error_of(demote)["code"] == "last_admin"
    assert "last admin of acme" in error_of(demote)["message"]
    leave = admin.delete("/api/v1/organizations/acme/members/admin/")
    assert leave.status_code == 409 and error_of(leave)["code"] == "last_admin"
    assert Membership.objects.get(user=world.admin, organization=world.acme).role == "admin"
    # With a second admin, either may step down.
    admin.post(
        "/api/v1/organizations/acme/members/", {"username": "bob", "role": "admin"}, format="json"
    )
    assert (
        admin.post(
            "/api/v1/organizations/acme/members/",
            {"username": "admin", "role": "trainer"},
            format="json",
        ).status_code
        == 200
    )
    # Now bob is the last one.
    assert api("bob").delete("/api/v1/organizations/acme/members/bob/").status_code == 409


def test_members_are_listed_a_page_at_a_time(world: World, api: Api) -> None:
    page = api("admin").get("/api/v1/organizations/acme/members/?page_size=2").json()
    assert set(page) == {"next", "previous", "results"}
    assert [m["username"] for m in page["results"]] == ["alice", "bob"]
    rest = api("admin").get(page["next"]).json()
    assert [m["username"] for m in rest["results"]] == ["admin"]


def test_an_agency_is_not_managed_through_the_api(world: World, api: Api) -> None:
    # Not even by a superuser: an agency's regulators are appointed with manage.py agency.
    world.users["root"] = make_user("root", superuser=True)
    for path, body in (
        ("/api/v1/organizations/eu-office/members/", {"username": "carol", "role": "admin"}),
        ("/api/v1/organizations/eu-office/invitations/", {"username": "bob", "role": "auditor"}),
    ):
        response = api("root").post(path, body, format="json")
        assert response.status_code == 409, response.content
        assert error_of(response)["code"] == "agency_members"
    # Lab admins do not even see the agency.
    assert api("admin").get("/api/v1/organizations/eu-office/members/").status_code == 404
