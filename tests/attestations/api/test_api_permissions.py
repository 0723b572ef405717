"""The permission matrix: every API endpoint against every role, inside and outside acme.

Expected codes: 404 where the object's organisation is out of the actor's sight (so ids
cannot be probed), 403 where it is visible but the role may not act, 401 anonymous.
Regulators (carol) read claims everywhere but never artifacts or upload sessions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.accounts.models import Invitation, Membership, Organization
from tests.attestations.base import SPEC, World, error_of, make_user, sha256

ACTORS = ("alice", "bob", "carol", "mallory", "admin", None)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    url: str
    expected: dict[str | None, int]
    body: Callable[[World], Any] | None = None
    headers: dict[str, str] | None = None
    raw: bytes | None = None


def codes(
    alice: int, bob: int, carol: int, mallory: int, admin: int, anon: int = 401
) -> dict[str | None, int]:
    return {
        "alice": alice,
        "bob": bob,
        "carol": carol,
        "mallory": mallory,
        "admin": admin,
        None: anon,
    }


READ = codes(200, 200, 200, 404, 200)
ALL = codes(200, 200, 200, 200, 200)
ARTIFACT_READ = codes(200, 403, 403, 404, 200)
ARTIFACT_WRITE = codes(200, 403, 403, 404, 200)

CASES = [
    Case("me", "get", "/api/v1/me/", ALL),
    Case("organizations", "get", "/api/v1/organizations/", ALL),
    Case("members", "get", "/api/v1/organizations/acme/members/", codes(200, 200, 403, 404, 200)),
    Case(
        "change role",
        "post",
        "/api/v1/organizations/acme/members/",
        codes(403, 403, 403, 404, 200),
        body=lambda w: {"username": "bob", "role": "trainer"},
    ),
    Case(
        # Nobody grants the regulator role through the API, not even a lab's admin.
        "grant regulator",
        "post",
        "/api/v1/organizations/acme/members/",
        codes(403, 403, 403, 404, 400),
        body=lambda w: {"username": "bob", "role": "regulator"},
    ),
    Case(
        # A non-member joins only by accepting an invitation.
        "add a member directly",
        "post",
        "/api/v1/organizations/acme/members/",
        codes(403, 403, 403, 404, 409),
        body=lambda w: {"username": "mallory", "role": "auditor"},
    ),
    Case(
        # bob may leave acme himself; only admins remove others.
        "remove member",
        "delete",
        "/api/v1/organizations/acme/members/bob/",
        codes(403, 204, 403, 404, 204),
    ),
    Case(
        "remove the last admin",
        "delete",
        "/api/v1/organizations/acme/members/admin/",
        codes(403, 403, 403, 404, 409),
    ),
    Case(
        "invitations",
        "get",
        "/api/v1/organizations/acme/invitations/",
        codes(403, 403, 403, 404, 200),
    ),
    Case(
        "invite",
        "post",
        "/api/v1/organizations/acme/invitations/",
        codes(403, 403, 403, 404, 201),
        body=lambda w: {"username": "mallory", "role": "auditor"},
    ),
    # Answered as any invitation: the inviter learns nothing (carol never sees it).
    Case(
        "invite a regulator",
        "post",
        "/api/v1/organizations/acme/invitations/",
        codes(403, 403, 403, 404, 201),
        body=lambda w: {"username": "carol", "role": "auditor"},
    ),
    Case(
        "invite as regulator",
        "post",
        "/api/v1/organizations/acme/invitations/",
        codes(403, 403, 403, 404, 400),
        body=lambda w: {"username": "mallory", "role": "regulator"},
    ),
    Case("my invitations", "get", "/api/v1/invitations/", ALL),
    Case(
        "accept another's invitation",
        "post",
        "/api/v1/invitations/{invitation}/accept/",
        codes(404, 404, 404, 200, 404),
    ),
    Case(
        "decline another's invitation",
        "post",
        "/api/v1/invitations/{invitation}/decline/",
        codes(404, 404, 404, 200, 404),
    ),
    Case("keys", "get", "/api/v1/keys/", ALL),
    # An API key never creates keys (issue 34): only a session that confirmed its
    # password does (test_security_round2.py).
    Case(
        "create key",
        "post",
        "/api/v1/keys/",
        codes(403, 403, 403, 403, 403),
        body=lambda w: {"name": "ci"},
    ),
    Case("experiments", "get", "/api/v1/experiments/", ALL),
    Case(
        "register experiment",
        "post",
        "/api/v1/experiments/",
        codes(201, 403, 403, 404, 201),
        body=lambda w: {"owner": "acme", "name": "run-2", "spec": SPEC},
    ),
    Case("experiment", "get", "/api/v1/experiments/acme/run-1/", READ),
    Case("specs", "get", "/api/v1/experiments/acme/run-1/specs/", READ),
    Case("spec", "get", "/api/v1/experiments/acme/run-1/specs/1/", READ),
    Case(
        "revise spec",
        "post",
        "/api/v1/experiments/acme/run-1/specs/",
        codes(201, 403, 403, 404, 201),
        body=lambda w: {**SPEC, "max_tokens": 10**12},
    ),
    Case("proofs", "get", "/api/v1/proofs/", ALL),
    Case("proof", "get", "/api/v1/proofs/{proof}/", READ),
    Case("transcript", "get", "/api/v1/proofs/{proof}/transcript/", ARTIFACT_READ),
    Case("jobs", "get", "/api/v1/jobs/", ALL),
    Case("job", "get", "/api/v1/jobs/{job}/", READ),
    Case("audit events", "get", "/api/v1/audit-events/", codes(200, 200, 403, 200, 200)),
    Case("uploads", "get", "/api/v1/uploads/", codes(200, 403, 403, 200, 200)),
    Case(
        "create upload",
        "post",
        "/api/v1/uploads/",
        codes(201, 403, 403, 404, 201),
        body=lambda w: {
            "experiment": "acme/run-1",
            "kind": "artifact",
            "size": 3,
            "sha256": sha256(b"abc"),
        },
    ),
    Case("upload", "get", "/api/v1/uploads/{upload}/", ARTIFACT_READ),
    Case(
        "upload part",
        "put",
        "/api/v1/uploads/{upload}/parts/1/",
        ARTIFACT_WRITE,
        headers={"HTTP_X_PART_SHA256": sha256(b"hello")},
        raw=b"hello",
    ),
    Case(
        # Missing parts: the upload's state conflicts with completion.
        "complete upload",
        "post",
        "/api/v1/uploads/{upload}/complete/",
        codes(409, 403, 403, 404, 409),
    ),
    Case("abort upload", "post", "/api/v1/uploads/{upload}/abort/", ARTIFACT_WRITE),
    Case("schema", "get", "/api/v1/schema/", codes(200, 200, 200, 200, 200, 200)),
    Case("docs", "get", "/api/v1/docs/", codes(200, 200, 200, 200, 200, 200)),
]


def _call(client: APIClient, case: Case, world: World) -> Any:
    invitation = None
    if "{invitation}" in case.url:
        # mallory's own invitation (to a second lab of hers): only she may answer it.
        second = Organization.objects.create(slug="evil-2", name="Evil Two")
        Membership.objects.create(user=world.admin, organization=second, role="admin")
        invitation, _ = Invitation.offer(second, "mallory", "auditor", actor=world.admin)
    url = case.url.format(
        proof=world.proof.pk,
        job=world.job.pk,
        upload=world.upload.pk,
        invitation=invitation.pk if invitation else None,
    )
    method = getattr(client, case.method)
    extra = dict(case.headers or {})
    if case.raw is not None:
        return method(url, data=case.raw, content_type="application/octet-stream", **extra)
    if case.body is not None:
        return method(url, data=case.body(world), format="json", **extra)
    return method(url, **extra)


@pytest.mark.parametrize("actor", ACTORS, ids=[a or "anonymous" for a in ACTORS])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_permission_matrix(
    case: Case, actor: str | None, world: World, api: Callable[[str | None], APIClient]
) -> None:
    response = _call(api(actor), case, world)
    expected = case.expected[actor]
    assert response.status_code == expected, (
        case.name,
        actor,
        getattr(response, "content", b"")[:300],
    )
    if expected >= 400 and case.url.startswith("/api/v1/") and "schema" not in case.url:
        error = error_of(response)
        assert error["code"]


def test_lists_are_scoped_to_the_organisation(
    world: World, api: Callable[[str | None], APIClient]
) -> None:
    names = {e["id"] for e in api("mallory").get("/api/v1/experiments/").json()["results"]}
    assert names == {"evil/heist"}
    assert api("mallory").get("/api/v1/proofs/").json()["results"] == []
    assert api("mallory").get("/api/v1/jobs/").json()["results"] == []
    assert api("mallory").get("/api/v1/uploads/").json()["results"] == []
    actions = {
        e["organization"] for e in api("mallory").get("/api/v1/audit-events/").json()["results"]
    }
    assert actions <= {"evil", None}


def test_regulator_reads_every_organisation(
    world: World, api: Callable[[str | None], APIClient]
) -> None:
    names = {e["id"] for e in api("carol").get("/api/v1/experiments/").json()["results"]}
    assert names == {"acme/run-1", "evil/heist"}
    slugs = {o["slug"] for o in api("carol").get("/api/v1/organizations/").json()["results"]}
    assert {"acme", "evil"} <= slugs


def test_bad_key_is_401_not_anonymous_fallback(world: World) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer dvb_000000000000_nope")
    response = client.get("/api/v1/me/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_only_the_creator_and_admins_change_an_open_upload(
    world: World, api: Callable[[str | None], APIClient]
) -> None:
    # dave is a trainer of acme too, but alice opened the upload.
    world.users["dave"] = make_user("dave")
    Membership.objects.create(user=world.users["dave"], organization=world.acme, role="trainer")
    url = f"/api/v1/uploads/{world.upload.pk}/"
    dave = api("dave")
    assert dave.get(url).status_code == 200  # he sees it (artifacts), but may not touch it
    part = dave.put(
        f"{url}parts/1/",
        data=b"hello",
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(b"hello"),
    )
    assert part.status_code == 403
    assert "opened by another member" in error_of(part)["message"]
    assert dave.post(f"{url}complete/").status_code == 403
    assert dave.post(f"{url}abort/").status_code == 403
    world.upload.refresh_from_db()
    assert world.upload.status == "open" and world.upload.parts.count() == 0
    # The lab's admin may abort it (a stuck upload of someone who left).
    assert api("admin").post(f"{url}abort/").status_code == 200


def _error_without_name(response: Any, name: str) -> tuple[int, dict[str, Any]]:
    error = error_of(response)
    return response.status_code, {**error, "message": error["message"].replace(name, "<name>")}


def test_an_invisible_experiment_is_answered_like_a_missing_one(
    world: World, api: Callable[[str | None], APIClient]
) -> None:
    body = {"kind": "artifact", "size": 3, "sha256": sha256(b"abc")}
    client = api("mallory")
    hidden = client.post("/api/v1/uploads/", {**body, "experiment": "acme/run-1"}, format="json")
    missing = client.post("/api/v1/uploads/", {**body, "experiment": "acme/run-0"}, format="json")
    assert _error_without_name(hidden, "acme/run-1") == _error_without_name(missing, "acme/run-0")
    assert hidden.status_code == 404 and error_of(hidden)["field"] == "experiment"


def test_an_organisation_one_is_not_in_is_answered_like_a_missing_one(
    world: World, api: Callable[[str | None], APIClient]
) -> None:
    client = api("mallory")
    hidden = client.post("/api/v1/experiments/", {"name": "acme/x", "spec": SPEC}, format="json")
    missing = client.post("/api/v1/experiments/", {"name": "acmf/x", "spec": SPEC}, format="json")
    assert _error_without_name(hidden, "acme") == _error_without_name(missing, "acmf")
    assert hidden.status_code == 404 and error_of(hidden)["code"] == "does_not_exist"
    # The form with a separate owner answers the same.
    separate = client.post(
        "/api/v1/experiments/", {"owner": "acme", "name": "x", "spec": SPEC}, format="json"
    )
    assert _error_without_name(separate, "acme") == _error_without_name(hidden, "acme")
