"""Web pages: the same permission matrix as the API, then what each page does."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from attestations.accounts.models import ApiKey, Invitation
from attestations.audit.models import AuditEvent
from attestations.experiments.models import Experiment
from tests.attestations.base import PASSWORD, SPEC, World

ACTORS = ("alice", "bob", "carol", "mallory", "admin", None)


def browser(world: World, actor: str | None) -> Client:
    client = Client()
    if actor is not None:
        assert client.login(username=actor, password=PASSWORD)
    return client


def codes(
    alice: int, bob: int, carol: int, mallory: int, admin: int, anon: int = 302
) -> dict[str | None, int]:
    return {
        "alice": alice,
        "bob": bob,
        "carol": carol,
        "mallory": mallory,
        "admin": admin,
        None: anon,
    }


PAGES: list[
    tuple[str, str, str, dict[str | None, int], Callable[[World], dict[str, Any]] | None]
] = [
    ("dashboard", "get", "/", codes(200, 200, 200, 200, 200), None),
    ("experiments", "get", "/experiments/", codes(200, 200, 200, 200, 200), None),
    ("register form", "get", "/experiments/new/", codes(200, 403, 403, 200, 200), None),
    (
        "register",
        "post",
        "/experiments/new/",
        codes(302, 403, 403, 200, 302),  # mallory may not pick acme: the form says so (200)
        lambda w: {**SPEC, "owner": "acme", "name": "run-7", "max_flops": "1000"},
    ),
    ("experiment", "get", "/experiments/acme/run-1/", codes(200, 200, 200, 404, 200), None),
    ("spec form", "get", "/experiments/acme/run-1/spec/", codes(200, 403, 403, 404, 200), None),
    (
        "change spec",
        "post",
        "/experiments/acme/run-1/spec/",
        codes(302, 403, 403, 404, 302),
        lambda w: {
            **SPEC,
            "optimizer": "sgd",
            "max_flops": "1000",
            "max_tokens": "",
            "max_gpu_hours": "",
        },
    ),
    ("proof", "get", "/proofs/{proof}/", codes(200, 200, 200, 404, 200), None),
    ("keys", "get", "/keys/", codes(200, 200, 200, 200, 200), None),
    # Creating a key needs a password confirmed in the last minutes (sudo mode) first.
    (
        "create key",
        "post",
        "/keys/",
        codes(403, 403, 403, 403, 403),
        lambda w: {"name": "x", "days": 30},
    ),
    (
        "confirm password",
        "post",
        "/keys/",
        codes(302, 302, 302, 302, 302),
        lambda w: {"action": "confirm", "password": PASSWORD},
    ),
    ("audit", "get", "/audit/", codes(200, 200, 403, 200, 200), None),
    ("organisation", "get", "/orgs/acme/", codes(200, 200, 403, 404, 200), None),
    (
        "invite member",
        "post",
        "/orgs/acme/",
        codes(403, 403, 403, 404, 302),
        lambda w: {"username": "mallory", "role": "auditor"},
    ),
    (
        "change role",
        "post",
        "/orgs/acme/members/bob/role/",
        codes(403, 403, 403, 404, 302),
        lambda w: {"role": "trainer"},
    ),
    (
        # bob may leave; only admins remove others.
        "remove member",
        "post",
        "/orgs/acme/members/bob/remove/",
        codes(403, 302, 403, 404, 302),
        None,
    ),
]


@pytest.mark.parametrize("actor", ACTORS, ids=[a or "anonymous" for a in ACTORS])
@pytest.mark.parametrize("page", PAGES, ids=[p[0] for p in PAGES])
def test_page_permission_matrix(page: Any, actor: str | None, world: World, settings: Any) -> None:
    name, method, url, expected, body = page
    client = browser(world, actor)
    url = url.format(proof=world.proof.pk)
    response = (
        client.post(url, body(world) if body else {}) if method == "post" else client.get(url)
    )
    assert response.status_code == expected[actor], (name, actor, response.content[:500])
    if actor is None:
        assert response["Location"].startswith("/login/")


def test_regulator_sees_claims_but_no_artifact_link(world: World) -> None:
    page = browser(world, "carol").get(f"/proofs/{world.proof.pk}/").content.decode()
    assert "Download transcript" not in page
    assert (
        "Download transcript"
        in browser(world, "alice").get(f"/proofs/{world.proof.pk}/").content.decode()
    )


def test_auditor_views_are_read_only(world: World) -> None:
    page = browser(world, "bob").get("/experiments/acme/run-1/").content.decode()
    assert "Change spec" not in page
    assert "Audit trail" in page
    assert "Register experiment" not in browser(world, "bob").get("/experiments/").content.decode()


def test_registration_shows_errors_inline(world: World) -> None:
    response = browser(world, "alice").post(
        "/experiments/new/",
        {
            **SPEC,
            "owner": "acme",
            "name": "Bad Name",
            "dataset_commitment": "zz",
            "max_flops": "1e25",
        },
    )
    assert response.status_code == 200
    form = response.context["form"]
    assert set(form.errors) == {"name", "dataset_commitment", "max_flops"}
    assert "has-error" in response.content.decode()


def test_registration_works(world: World) -> None:
    response = browser(world, "alice").post(
        "/experiments/new/",
        {**SPEC, "owner": "acme", "name": "run-7", "max_flops": "100000000000000000000000000"},
    )
    assert response.status_code == 302
    experiment = Experiment.objects.get(owner__slug="acme", name="run-7")
    assert experiment.current_spec is not None
    assert int(experiment.current_spec.max_flops or 0) == 10**26
    assert AuditEvent.objects.filter(
        action="experiment.registered", target_id=str(experiment.pk)
    ).exists()


def confirmed(client: Client) -> Client:
    """``client`` after confirming its password on ``/keys/`` (sudo mode: keys may be made)."""
    response = client.post("/keys/", {"action": "confirm", "password": PASSWORD})
    assert response.status_code == 302, response.content
    return client


def test_a_new_key_is_shown_once(world: World) -> None:
    client = confirmed(browser(world, "alice"))
    response = client.post("/keys/", {"name": "laptop", "days": 30})
    raw = response.context["created"][1]
    assert raw in response.content.decode()
    assert raw not in client.get("/keys/").content.decode()
    assert response["Cache-Control"].startswith("max-age=0")
    key = ApiKey.objects.get(name="laptop")
    client.post(f"/keys/{key.pk}/revoke/")
    key.refresh_from_db()
    assert key.revoked is not None


def test_keys_of_others_cannot_be_revoked(world: World) -> None:
    key, _ = ApiKey.issue(world.alice, "x")
    assert browser(world, "mallory").post(f"/keys/{key.pk}/revoke/").status_code == 404
    key.refresh_from_db()
    assert key.revoked is None


def test_admins_manage_members_and_it_is_audited(world: World) -> None:
    client = browser(world, "admin")
    client.post("/orgs/acme/", {"username": "mallory", "role": "auditor"})
    # An invitation, not a membership: mallory has not said yes.
    assert not world.mallory.memberships.filter(organization=world.acme).exists()
    invitation = Invitation.objects.get(user=world.mallory, organization=world.acme)
    invitee = browser(world, "mallory")
    dashboard = invitee.get("/").content.decode()
    assert "Acme Labs" in dashboard and "invites you as" in dashboard
    assert invitee.post(f"/invitations/{invitation.pk}/accept/").status_code == 302
    assert world.mallory.memberships.get(organization=world.acme).role == "auditor"
    client.post("/orgs/acme/members/mallory/role/", {"role": "trainer"})
    assert world.mallory.memberships.get(organization=world.acme).role == "trainer"
    client.post("/orgs/acme/members/mallory/remove/")
    assert not world.mallory.memberships.filter(organization=world.acme).exists()
    actions = list(
        AuditEvent.objects.filter(action__regex=r"^(membership|invitation)\.")
        .order_by("created")
        .values_list("action", flat=True)
    )
    assert actions == [
        "invitation.created",
        "invitation.accepted",
        "membership.added",
        "membership.changed",
        "membership.removed",
    ]


def test_the_member_form_never_offers_the_regulator_role(world: World) -> None:
    page = browser(world, "admin").get("/orgs/acme/").content.decode()
    assert 'value="auditor"' in page
    assert 'value="regulator"' not in page
    response = browser(world, "admin").post("/orgs/acme/", {"username": "bob", "role": "regulator"})
    assert response.status_code == 200
    assert "Select a valid choice" in response.content.decode()
    assert world.bob.memberships.get(organization=world.acme).role == "auditor"


def test_the_last_admin_cannot_leave_or_demote_themselves(world: World) -> None:
    client = browser(world, "admin")
    left = client.post("/orgs/acme/members/admin/remove/", follow=True)
    assert "last admin" in left.content.decode()
    demoted = client.post("/orgs/acme/members/admin/role/", {"role": "auditor"}, follow=True)
    assert "last admin" in demoted.content.decode()
    assert world.admin.memberships.get(organization=world.acme).role == "admin"


def test_an_unknown_user_is_invited_like_anyone(world: World) -> None:
    # The form does not say whether a name is held (issue 34): the invitation is pending,
    # and nobody can see it.
    client = browser(world, "admin")
    response = client.post("/orgs/acme/", {"username": "nobody", "role": "auditor"}, follow=True)
    assert response.status_code == 200
    html = response.content.decode()
    assert "Invited nobody as auditor" in html and "No active user" not in html
    assert "<td>nobody</td>" in html


def test_upload_sessions_show_to_trainers_not_auditors(world: World) -> None:
    assert "Uploads" in browser(world, "alice").get("/experiments/acme/run-1/").content.decode()
    assert (
        "<h2>Uploads</h2>"
        not in browser(world, "bob").get("/experiments/acme/run-1/").content.decode()
    )
    assert (
        "<h2>Uploads</h2>"
        not in browser(world, "carol").get("/experiments/acme/run-1/").content.decode()
    )


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)


def test_no_page_carries_an_inline_script_or_handler(world: World) -> None:
    """The CSP allows scripts from files only; no page may depend on anything inline.

    (The browser test sees violations as they happen; this sees every handler attribute,
    including those whose event never fires in that test.)
    """
    from django.contrib.auth.models import User

    User.objects.create_superuser("root", "root@example.org", PASSWORD)
    Invitation.offer(world.acme, "mallory", "auditor", actor=world.admin)
    pages = {
        "admin": [
            "/",
            "/experiments/",
            "/experiments/new/",
            "/experiments/acme/run-1/",
            "/experiments/acme/run-1/spec/",
            f"/proofs/{world.proof.pk}/",
            f"/proofs/{world.proof.pk}/report/",
            "/keys/",
            "/audit/",
            "/orgs/acme/",
            "/api/v1/docs/",
            "/api/v1/redoc/",
            "/api/v1/experiments/?format=api",
        ],
        "mallory": ["/"],  # with an invitation to answer
        "root": [
            "/admin/",
            "/admin/accounts/organization/",
            f"/admin/accounts/organization/{world.acme.pk}/change/",
            "/admin/proofs/proof/",
        ],
        None: ["/login/"],
    }
    for actor, paths in pages.items():
        client = browser(world, actor)
        for path in paths:
            response = client.get(path)
            assert response.status_code == 200, (actor, path, response.status_code)
            html = response.content.decode()
            assert not INLINE_SCRIPT.findall(html), (path, INLINE_SCRIPT.findall(html))
            assert not INLINE_HANDLER.findall(html), (path, INLINE_HANDLER.findall(html)[:3])
    # The page that shows a new key once.
    created = confirmed(browser(world, "alice")).post("/keys/", {"name": "laptop", "days": 30})
    assert "dvb_" in created.content.decode()
    assert not INLINE_HANDLER.findall(created.content.decode())
