"""Security round 2 (issue 34), findings 1, 5, 7 and 8: one test (or a few) per finding.

* 1. An API key created API keys that outlived it: keys are now created only by a
  signed-in session that confirmed its password in the last minutes (sudo mode), never
  by a key; no key lives longer than ``DVBENCH_API_KEY_MAX_DAYS``.
* 5. Errors revealed what exists: an organisation out of sight and one that does not
  exist are one 404; an invitation is answered the same for any username.
* 7. Gunicorn's own refusals (414, 400) were HTML: now the API's JSON error document.
* 8. Signed-in pages carried no ``Cache-Control``: now ``no-store, private``.

docs/reliability.md, section 8, has the attack, the test and the outcome of each.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey, Invitation, Membership
from attestations.audit.models import AuditEvent
from attestations.core.errors import InvalidRequestError
from attestations.http import sudo
from attestations.http.exceptions import error_body
from tests.attestations.base import PASSWORD, World, error_of, make_user, sudo_session
from tests.reliability.stack import gunicorn

Api = Callable[[str | None], APIClient]
REPO = Path(__file__).resolve().parent.parent.parent


def fresh_ip() -> str:
    """A documentation address (RFC 5737) unique to the test, so counters never collide."""
    n = uuid.uuid4().int
    return f"203.0.{n % 250}.{(n >> 8) % 250 + 1}"


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


# --- 1. Keys that mint keys ---------------------------------------------------------------


def test_the_reported_attack_an_api_key_cannot_create_a_key(world: World) -> None:
    # The report: with key A (90 days), POST keys/ {"name": "B", "days": 365} gave 201, and
    # B kept working after A was revoked.
    key_a, raw_a = ApiKey.issue(world.alice, "A", days=90)
    response = bearer(raw_a).post("/api/v1/keys/", {"name": "B", "days": 365}, format="json")
    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "api_key_cannot_create_keys"
    assert "API key cannot create API keys" in error["message"]
    assert list(ApiKey.objects.filter(user=world.alice).values_list("name", flat=True)) == ["A"]
    # Nor can it open sudo mode, whatever it sends.
    confirm = bearer(raw_a).post(
        "/api/v1/keys/confirm-password/", {"password": PASSWORD}, format="json"
    )
    assert confirm.status_code == 403
    assert error_of(confirm)["code"] == "api_key_cannot_create_keys"
    # Revoking A ends every access it gave: there is nothing it made.
    assert bearer(raw_a).post(f"/api/v1/keys/{key_a.pk}/revoke/").status_code == 200
    assert bearer(raw_a).get("/api/v1/me/").status_code == 401
    assert ApiKey.objects.filter(user=world.alice).active().count() == 0


def test_a_key_cannot_create_keys_even_with_a_confirmed_session_cookie(world: World) -> None:
    # A request carrying both a key and a session in sudo mode is a key's request.
    session = sudo_session(world, "alice")
    _, raw = ApiKey.issue(world.alice, "ci")
    session.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    response = session.post("/api/v1/keys/", {"name": "B"}, format="json")
    assert response.status_code == 403
    assert error_of(response)["code"] == "api_key_cannot_create_keys"


def test_a_session_creates_keys_only_after_confirming_its_password(
    world: World, settings: Any
) -> None:
    client = APIClient()
    client.force_login(world.alice)
    refused = client.post("/api/v1/keys/", {"name": "laptop"}, format="json")
    assert refused.status_code == 403
    assert error_of(refused)["code"] == "password_confirmation_required"
    assert "/keys/" in error_of(refused)["message"]
    wrong = client.post("/api/v1/keys/confirm-password/", {"password": "guess"}, format="json")
    assert wrong.status_code == 400
    assert (error_of(wrong)["code"], error_of(wrong)["field"]) == ("wrong_password", "password")
    assert client.post("/api/v1/keys/", {"name": "laptop"}, format="json").status_code == 403
    right = client.post("/api/v1/keys/confirm-password/", {"password": PASSWORD}, format="json")
    assert right.status_code == 200
    assert 0 < right.json()["seconds_left"] <= settings.DVBENCH["SUDO_SECONDS"]
    created = client.post("/api/v1/keys/", {"name": "laptop"}, format="json")
    assert created.status_code == 201, created.content
    assert bearer(created.json()["key"]).get("/api/v1/me/").json()["username"] == "alice"
    # The confirmation runs out: the session must confirm again.
    session = client.session
    mark = session[sudo.SESSION_KEY]
    mark["at"] -= settings.DVBENCH["SUDO_SECONDS"] + 1
    session[sudo.SESSION_KEY] = mark
    session.save()
    late = client.post("/api/v1/keys/", {"name": "later"}, format="json")
    assert late.status_code == 403
    assert error_of(late)["code"] == "password_confirmation_required"


def test_a_confirmation_belongs_to_the_user_who_made_it(world: World) -> None:
    client = sudo_session(world, "alice")
    # A mark left by another user (bob confirmed, then alice signed in on that browser
    # without the session being flushed) opens nothing for alice.
    session = client.session
    session[sudo.SESSION_KEY] = {"user": world.bob.pk, "at": time.time()}
    session.save()
    response = client.post("/api/v1/keys/", {"name": "x"}, format="json")
    assert response.status_code == 403
    assert error_of(response)["code"] == "password_confirmation_required"


def test_signing_out_ends_sudo_mode(world: World) -> None:
    client = Client()
    assert client.login(username="alice", password=PASSWORD)
    assert client.post("/keys/", {"action": "confirm", "password": PASSWORD}).status_code == 302
    client.post("/logout/")
    assert client.login(username="alice", password=PASSWORD)
    assert client.post("/keys/", {"name": "after", "days": 30}).status_code == 403
    assert not ApiKey.objects.filter(name="after").exists()


def test_wrong_passwords_count_towards_the_sign_in_limit(world: World, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "login_failures": "3/hour"}
    username = f"sudoer-{uuid.uuid4().hex[:8]}"
    user = User.objects.create_user(username, password=PASSWORD)
    client = APIClient(REMOTE_ADDR=fresh_ip())
    client.force_login(user)
    for _ in range(3):
        response = client.post(
            "/api/v1/keys/confirm-password/", {"password": "guess"}, format="json"
        )
        assert response.status_code == 400
    throttled = client.post("/api/v1/keys/confirm-password/", {"password": PASSWORD}, format="json")
    assert throttled.status_code == 429
    assert error_of(throttled)["code"] == "throttled"
    assert 1 <= int(throttled["Retry-After"]) <= 3600
    # Refused without the password being checked: no sudo mode.
    assert client.post("/api/v1/keys/", {"name": "x"}, format="json").status_code == 403
    # The web form says so too, with 429.
    web = Client(REMOTE_ADDR=fresh_ip())
    web.force_login(user)
    page = web.post("/keys/", {"action": "confirm", "password": PASSWORD})
    assert page.status_code == 429 and "Too many wrong passwords" in page.content.decode()


def test_the_web_page_asks_for_the_password_before_the_key(world: World) -> None:
    client = Client()
    assert client.login(username="alice", password=PASSWORD)
    page = client.get("/keys/").content.decode()
    assert 'name="password"' in page and "Create key" not in page
    refused = client.post("/keys/", {"name": "early", "days": 30})
    assert refused.status_code == 403 and "Confirm your password first" in refused.content.decode()
    wrong = client.post("/keys/", {"action": "confirm", "password": "guess"})
    assert wrong.status_code == 400 and "not your password" in wrong.content.decode()
    assert client.post("/keys/", {"action": "confirm", "password": PASSWORD}).status_code == 302
    assert "Create key" in client.get("/keys/").content.decode()
    created = client.post("/keys/", {"name": "now", "days": 30})
    assert created.status_code == 200 and "dvb_" in created.content.decode()
    assert not ApiKey.objects.filter(name="early").exists()


def test_no_key_outlives_the_policy_maximum(world: World, settings: Any) -> None:
    client = sudo_session(world, "alice")
    too_long = client.post("/api/v1/keys/", {"name": "long", "days": 366}, format="json")
    assert too_long.status_code == 400
    assert error_of(too_long)["field"] == "days"
    assert "365" in error_of(too_long)["message"]
    settings.DVBENCH = {**settings.DVBENCH, "API_KEY_MAX_DAYS": 30}
    refused = client.post("/api/v1/keys/", {"name": "long", "days": 31}, format="json")
    assert refused.status_code == 400 and "30" in error_of(refused)["message"]
    made = client.post("/api/v1/keys/", {"name": "month", "days": 30}, format="json")
    assert made.status_code == 201
    key = ApiKey.objects.get(name="month")
    assert key.expires - key.created <= timedelta(days=30)
    # The web form and the model say the same, whoever calls them.
    web = Client()
    assert web.login(username="alice", password=PASSWORD)
    web.post("/keys/", {"action": "confirm", "password": PASSWORD})
    form = web.post("/keys/", {"name": "web-long", "days": 31})
    assert "less than or equal to 30" in form.content.decode()
    with pytest.raises(InvalidRequestError, match="1 to 30 days"):
        ApiKey.issue(world.alice, "direct", days=31)
    assert not ApiKey.objects.filter(name__in=["long", "web-long", "direct"]).exists()
    # A default lifetime over the maximum cannot be configured.
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=REPO,
        env=dict(
            os.environ,
            DJANGO_SETTINGS_MODULE="config.settings",
            DVBENCH_API_KEY_TTL_DAYS="400",
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "DVBENCH_API_KEY_MAX_DAYS" in result.stderr


# --- 5. Errors that reveal what exists ------------------------------------------------------

ORGANISATION_REQUESTS = [
    ("get", "members/", None),
    ("post", "members/", {"username": "alice", "role": "auditor"}),
    ("delete", "members/alice/", None),
    ("get", "invitations/", None),
    ("post", "invitations/", {"username": "bob", "role": "auditor"}),
    ("delete", f"invitations/{uuid.UUID(int=1)}/", None),
]


@pytest.mark.parametrize(("method", "tail", "body"), ORGANISATION_REQUESTS)
def test_an_organisation_out_of_sight_is_answered_like_a_missing_one(
    world: World, api: Api, method: str, tail: str, body: Any
) -> None:
    # The report: GET organizations/demo/members/ from another lab gave 404 "Not found.",
    # an unknown slug 404 "No organisation 'doesnotexist'.".
    client = api("mallory")

    def call(slug: str) -> Any:
        return getattr(client, method)(
            f"/api/v1/organizations/{slug}/{tail}",
            body,
            format="json",
            HTTP_X_REQUEST_ID="probe-0001",
        )

    hidden, missing = call("acme"), call("acmf")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.content == missing.content
    assert dict(hidden.headers) == dict(missing.headers)
    assert error_of(hidden)["field"] == "slug"


def test_an_organisation_page_out_of_sight_is_answered_like_a_missing_one(world: World) -> None:
    client = Client()
    assert client.login(username="mallory", password=PASSWORD)

    def page(path: str) -> tuple[int, str]:
        response = client.get(path)
        # The page's CSRF tokens are masked afresh for each response.
        text = re.sub(r'value="[A-Za-z0-9]{64}"', 'value="…"', response.content.decode())
        return response.status_code, text

    assert page("/orgs/acme/") == page("/orgs/acmf/")
    assert page("/orgs/acme/")[0] == 404


def _invite(client: APIClient, username: str) -> Any:
    return client.post(
        "/api/v1/organizations/acme/invitations/",
        {"username": username, "role": "auditor"},
        format="json",
    )


def test_invitations_answer_the_same_for_any_username(world: World, api: Api) -> None:
    # The report: an unknown username gave 404 unknown_user, the agency's user 409
    # "regulator is a regulator (agency agency)": a lab admin could enumerate usernames
    # and find regulators.
    inactive = make_user("gone")
    inactive.is_active = False
    inactive.save()
    admin = api("admin")
    names = ["mallory", "nobody-by-this-name", "carol", "gone"]
    responses = {name: _invite(admin, name) for name in names}

    def shape(response: Any) -> tuple[int, list[str], dict[str, Any]]:
        body = response.json()
        variable = {"id", "username", "created", "expires"}
        return (
            response.status_code,
            sorted(body),
            {k: v for k, v in body.items() if k not in variable},
        )

    shapes = {name: shape(response) for name, response in responses.items()}
    assert all(s == shapes["mallory"] for s in shapes.values()), shapes
    assert shapes["mallory"][0] == 201
    assert shapes["mallory"][2]["status"] == "pending"
    # The lab's list and its audit trail show each the same way.
    listed = admin.get("/api/v1/organizations/acme/invitations/").json()["results"]
    assert sorted(i["username"] for i in listed) == sorted(names)
    events = AuditEvent.objects.filter(action="invitation.created")
    assert sorted(e.detail["username"] for e in events) == sorted(names)
    assert all(set(e.detail) == {"username", "role"} for e in events)
    # Asked again, each is the same 200 (the pending invitation, its role changed).
    again = {name: _invite(admin, name).status_code for name in names}
    assert set(again.values()) == {200}
    # Only an existing user who may join sees theirs.
    assert [i["organization"] for i in api("mallory").get("/api/v1/invitations/").json()["results"]]
    assert api("carol").get("/api/v1/invitations/").json()["results"] == []
    carol_id = responses["carol"].json()["id"]
    assert api("carol").post(f"/api/v1/invitations/{carol_id}/accept/").status_code == 404
    # A regulator never has a lab invitation: no row names carol as its user.
    assert not Invitation.objects.filter(user=world.carol).exists()
    assert not Invitation.objects.filter(user=inactive).exists()
    assert not Membership.objects.filter(user=world.carol, organization=world.acme).exists()


def test_the_invitation_form_answers_the_same_for_any_username(world: World) -> None:
    client = Client()
    assert client.login(username="admin", password=PASSWORD)
    pages = {}
    for name in ("mallory", "nobody-by-this-name", "carol"):
        response = client.post("/orgs/acme/", {"username": name, "role": "auditor"})
        assert response.status_code == 302, (name, response.status_code)
        pages[name] = client.get("/orgs/acme/").content.decode()
    for name, html in pages.items():
        assert f"Invited {name} as auditor" in html
        assert "regulator" not in html.split("Pending invitations")[1].split("</table>")[0]


def test_a_role_change_answers_the_same_for_unknown_and_existing_non_members(
    world: World, api: Api
) -> None:
    admin = api("admin")

    def change(username: str) -> dict[str, Any]:
        response = admin.post(
            "/api/v1/organizations/acme/members/",
            {"username": username, "role": "auditor"},
            format="json",
        )
        assert response.status_code == 409
        error = error_of(response)
        error["message"] = error["message"].replace(username, "<name>")
        error["detail"] = {k: v.replace(username, "<name>") for k, v in error["detail"].items()}
        return error

    assert change("mallory") == change("nobody-by-this-name") == change("carol")
    assert change("mallory")["code"] == "invitation_required"


# --- 7. Errors outside the API's format (gunicorn) -------------------------------------------


@pytest.fixture(scope="module")
def gunicorn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The real gunicorn, with the platform's configuration, in a subprocess."""
    log = tmp_path_factory.mktemp("gunicorn") / "server.log"
    environment = dict(os.environ, DJANGO_SETTINGS_MODULE="config.settings")
    environment.setdefault("DVBENCH_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    with gunicorn(environment, log) as port:
        yield "127.0.0.1", port


def _raw(address: tuple[str, int], request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; the status, headers (lower-case names) and body of the answer."""
    with socket.create_connection(address, timeout=30) as connection:
        connection.sendall(request)
        connection.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def _assert_api_error(headers: dict[str, str], body: bytes) -> dict[str, Any]:
    assert headers["content-type"] == "application/json", (headers, body[:200])
    document = json.loads(body)
    shape = error_body("c", "m", field=None, detail=None, request_id="r")
    assert set(document) == set(shape) and set(document["error"]) == set(shape["error"])
    assert document["request_id"] == headers["x-request-id"]
    assert int(headers["content-length"]) == len(body)
    error: dict[str, Any] = document["error"]
    return error


@pytest.mark.services
def test_a_request_line_over_the_limit_is_a_json_414(gunicorn_server: tuple[str, int]) -> None:
    # The report: over 4,094 bytes, gunicorn's HTML 414.
    path = "/api/v1/experiments/?q=" + "a" * 5000
    status, headers, body = _raw(
        gunicorn_server, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
    )
    assert status == 414
    error = _assert_api_error(headers, body)
    assert error["code"] == "uri_too_long"
    assert error["field"] == "path" and error["detail"] == {"limit": 4094}
    assert "4094 bytes" in error["message"]


@pytest.mark.services
def test_a_non_numeric_content_length_is_a_json_400(gunicorn_server: tuple[str, int]) -> None:
    # The report: Content-Length: abc, gunicorn's HTML 400.
    status, headers, body = _raw(
        gunicorn_server,
        b"POST /api/v1/keys/ HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n",
    )
    assert status == 400
    error = _assert_api_error(headers, body)
    assert (error["code"], error["field"]) == ("invalid_header", "Content-Length")
    assert "whole number" in error["message"]


@pytest.mark.services
def test_other_gunicorn_refusals_are_json_with_gunicorn_statuses(
    gunicorn_server: tuple[str, int],
) -> None:
    cases = [
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400),
        (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    ]
    for request, expected in cases:
        status, headers, body = _raw(gunicorn_server, request)
        assert status == expected, (request[:60], status, body[:200])
        _assert_api_error(headers, body)
    # And the application behind it still answers, in the same format.
    status, headers, body = _raw(
        gunicorn_server, b"GET /api/v1/me/ HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    assert status == 401
    assert _assert_api_error(headers, body)["code"] == "not_authenticated"


# --- 8. Caching of signed-in pages -----------------------------------------------------------


def _web_routes() -> Iterator[tuple[str, str]]:
    """``(name, route)`` of every web page (the API and the admin left out)."""

    def walk(patterns: list[Any], prefix: str) -> Iterator[tuple[str, str]]:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                if route.startswith(("api/", "admin/")):
                    continue
                yield from walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern) and pattern.name:
                yield pattern.name, route

    yield from walk(get_resolver().url_patterns, "")


def test_every_signed_in_page_is_no_store_private(world: World) -> None:
    invitation, _ = Invitation.offer(world.acme, "mallory", "auditor", actor=world.admin)
    key, _ = ApiKey.issue(world.admin, "x")
    proof = world.proof.pk
    # Each web route, as the admin would request it: GET pages, and the POST-only ones.
    requests: dict[str, tuple[str, str, dict[str, str]]] = {
        "dashboard": ("get", "/", {}),
        "experiments": ("get", "/experiments/", {}),
        "experiment-new": ("get", "/experiments/new/", {}),
        "experiment": ("get", "/experiments/acme/run-1/", {}),
        "experiment-spec": ("get", "/experiments/acme/run-1/spec/", {}),
        "proof": ("get", f"/proofs/{proof}/", {}),
        "proof-report": ("get", f"/proofs/{proof}/report/", {}),
        "proof-report-pdf": ("get", f"/proofs/{proof}/report.pdf", {}),
        "api-keys": ("get", "/keys/", {}),
        "api-key-revoke": ("post", f"/keys/{key.pk}/revoke/", {}),
        "audit": ("get", "/audit/", {}),
        "organization": ("get", "/orgs/acme/", {}),
        "organization-role": ("post", "/orgs/acme/members/bob/role/", {"role": "auditor"}),
        "organization-remove": ("post", "/orgs/acme/members/alice/remove/", {}),
        "invitation-revoke": ("post", f"/orgs/acme/invitations/{invitation.pk}/revoke/", {}),
        "invitation-answer": ("post", f"/invitations/{uuid.UUID(int=7)}/accept/", {}),
        "logout": ("post", "/logout/", {}),
    }
    public = {"health", "login"}
    names = {name for name, _ in _web_routes()}
    assert names - public == set(requests), "a web page this test does not request"
    for name, (method, path, data) in requests.items():
        client = Client()
        assert client.login(username="admin", password=PASSWORD)
        response = getattr(client, method)(path, data)
        assert response.status_code < 500, (name, response.status_code)
        directives = {d.strip() for d in response.get("Cache-Control", "").split(",")}
        assert {"no-store", "private"} <= directives, (name, response.get("Cache-Control"))
    # The API's answers to a key too.
    _, raw = ApiKey.issue(world.bob, "reader")
    response = bearer(raw).get("/api/v1/experiments/")
    assert response["Cache-Control"] == "no-store, private"


def test_anonymous_public_answers_keep_their_caching(world: World) -> None:
    # Nothing private in them: the middleware leaves them as they were.
    response = Client().get("/api/v1/log/checkpoint/")
    assert "private" not in response.get("Cache-Control", "")


def test_the_new_key_page_keeps_its_stricter_header(world: World) -> None:
    # The page that shows a new key keeps never_cache's stricter header.
    client = Client()
    assert client.login(username="alice", password=PASSWORD)
    client.post("/keys/", {"action": "confirm", "password": PASSWORD})
    response = client.post("/keys/", {"name": "shown", "days": 30})
    directives = {d.strip() for d in response["Cache-Control"].split(",")}
    assert {"no-store", "private", "no-cache", "must-revalidate"} <= directives
    assert ApiKey.objects.get(name="shown").expires < timezone.now() + timedelta(days=31)
