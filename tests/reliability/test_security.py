"""Security settings and behaviour: cookies, headers, rate limits, API keys, audit, logs.

One test (or a few) per item of issue 11's security list:

* CSRF on the web forms and on session-authenticated API writes; Secure, HttpOnly and
  SameSite cookies whenever the deployment says it is behind TLS.
* Security headers on pages and API responses (HSTS when configured).
* Rate limits: sign-in failures (per address and per username), API key failures (per
  address), upload endpoints (per user): 429 with ``Retry-After``, in the API's error
  format for the API.
* API keys: only a hash is stored; the comparison is constant-time.
* Audit trail: every privileged action through the API leaves an event.
* No secret in logs: an API key and a password never reach a log record.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey
from attestations.audit.models import AuditEvent
from attestations.http.throttling import FixedWindow
from tests.attestations.base import (
    PASSWORD,
    World,
    error_of,
    open_upload,
    sha256,
    sudo_session,
    upload_blob,
)

Api = Callable[[str | None], APIClient]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fresh_ip() -> str:
    """A documentation address (RFC 5737) unique to the test, so counters never collide."""
    n = uuid.uuid4().int
    return f"198.51.{n % 250}.{(n >> 8) % 250 + 1}"


def settings_in_subprocess(env: dict[str, str], expression: str) -> str:
    """Evaluate ``expression`` over freshly imported settings under ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DVBENCH_", "DJANGO_"))}
    environment.update(env, DJANGO_SETTINGS_MODULE="config.settings")
    environment.setdefault(
        "DVBENCH_DATA_DIR", os.environ.get("DVBENCH_DATA_DIR", "/tmp/dvbench-sec")
    )
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        f"print(*({expression},))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# --- Cookies and CSRF ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "secure"),
    [
        ({}, "False"),
        ({"DVBENCH_BEHIND_PROXY": "1"}, "True"),
        ({"DVBENCH_SSL_REDIRECT": "1"}, "True"),
        ({"DVBENCH_HSTS_SECONDS": "31536000"}, "True"),
        ({"DVBENCH_BEHIND_PROXY": "1", "DVBENCH_SECURE_COOKIES": "0"}, "False"),
        ({"DVBENCH_SECURE_COOKIES": "1"}, "True"),
    ],
)
def test_cookies_are_secure_whenever_served_over_tls(env: dict[str, str], secure: str) -> None:
    got = settings_in_subprocess(
        env,
        "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SESSION_COOKIE_HTTPONLY, "
        "s.CSRF_COOKIE_HTTPONLY, s.SESSION_COOKIE_SAMESITE",
    )
    assert got == f"{secure} {secure} True True Lax"


def test_a_bad_rate_setting_fails_loudly() -> None:
    environment = dict(
        os.environ, DVBENCH_RATE_UPLOADS="lots", DJANGO_SETTINGS_MODULE="config.settings"
    )
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "DVBENCH_RATE_UPLOADS" in result.stderr


def test_signed_in_cookies_are_httponly_and_samesite(world: World, settings: Any) -> None:
    settings.SESSION_COOKIE_SECURE = True
    settings.CSRF_COOKIE_SECURE = True
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    token = page.cookies["csrftoken"].value
    response = client.post(
        "/login/", {"username": "alice", "password": PASSWORD, "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 302
    session = response.cookies["sessionid"]
    assert session["secure"] and session["httponly"] and session["samesite"] == "Lax"
    assert page.cookies["csrftoken"]["secure"] and page.cookies["csrftoken"]["httponly"]


def test_web_forms_require_the_csrf_token(world: World) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.alice)
    response = client.post("/keys/", {"name": "no token"})
    assert response.status_code == 403
    assert not ApiKey.objects.filter(name="no token").exists()


def test_session_authenticated_api_writes_require_the_csrf_token(world: World) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(world.alice)
    response = client.post("/api/v1/keys/", {"name": "no token"}, format="json")
    assert response.status_code == 403
    assert error_of(response)["code"] == "permission_denied"
    assert "CSRF" in error_of(response)["message"]
    assert not ApiKey.objects.filter(name="no token").exists()


def test_api_key_requests_need_no_csrf_token(world: World, api: Api) -> None:
    # A bearer key is not sent by a browser on its own, so CSRF does not apply to it.
    key, _ = ApiKey.issue(world.alice, "scripted")
    response = api("alice").post(f"/api/v1/keys/{key.pk}/revoke/")
    assert response.status_code == 200


# --- Security headers ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/login/", "/api/v1/me/", "/api/v1/docs/", "/health"])
def test_security_headers_on_pages_and_api(world: World, path: str) -> None:
    response = Client().get(path)
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    assert response["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in response["Content-Security-Policy"]
    assert "object-src 'none'" in response["Content-Security-Policy"]
    if path != "/api/v1/docs/":  # Swagger UI relaxes it for its OAuth pop-up
        assert response["Cross-Origin-Opener-Policy"] == "same-origin"
    assert "camera=()" in response["Permissions-Policy"]
    assert "Strict-Transport-Security" not in response  # HSTS only when configured


def test_hsts_when_configured(world: World, settings: Any) -> None:
    settings.SECURE_HSTS_SECONDS = 31536000
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    response = Client().get("/login/", secure=True)
    assert response["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
    # Never over plain HTTP, where a proxy could strip or forge it.
    assert "Strict-Transport-Security" not in Client().get("/login/")


# --- Rate limits --------------------------------------------------------------------------
# Limits per hour, not per minute: counters are fixed windows, and a test that straddles a
# window boundary would see its count reset.


def test_sign_in_failures_are_limited_per_address(world: World, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "login_failures": "3/hour"}
    ip = fresh_ip()
    client = Client(REMOTE_ADDR=ip)
    # Usernames unique to the run: their counters live in the cache, which outlives a run
    # (the file cache under the data directory), and a per-username limit applies too.
    run = uuid.uuid4().hex[:8]
    for attempt in range(3):
        response = client.post(
            "/login/", {"username": f"nobody{attempt}-{run}", "password": "guess"}
        )
        assert response.status_code == 200  # the form again, with an error
    response = client.post("/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 429
    assert 1 <= int(response["Retry-After"]) <= 3600
    assert "_auth_user_id" not in client.session  # refused without checking the password
    # Another address is not affected; the admin sign-in shares the limit.
    assert (
        Client(REMOTE_ADDR=fresh_ip())
        .post("/login/", {"username": "alice", "password": PASSWORD})
        .status_code
        == 302
    )
    assert client.post("/admin/login/", {"username": "admin", "password": "x"}).status_code == 429


def test_sign_in_failures_are_limited_per_username(world: World, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "login_failures": "3/hour"}
    username = f"victim-{uuid.uuid4().hex[:8]}"
    User.objects.create_user(username, password=PASSWORD)
    for _ in range(3):  # a spread of addresses guessing one account
        Client(REMOTE_ADDR=fresh_ip()).post("/login/", {"username": username, "password": "guess"})
    response = Client(REMOTE_ADDR=fresh_ip()).post(
        "/login/", {"username": username.upper(), "password": PASSWORD}
    )
    assert response.status_code == 429


def test_successful_sign_ins_are_not_counted(world: World, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "login_failures": "2/hour"}
    ip = fresh_ip()
    for _ in range(4):
        client = Client(REMOTE_ADDR=ip)
        assert client.post("/login/", {"username": "bob", "password": PASSWORD}).status_code == 302


def test_api_key_failures_are_limited_per_address(world: World, api: Api, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "api_key_failures": "3/hour"}
    ip = fresh_ip()
    _, good = ApiKey.issue(world.alice, "good")
    bad = APIClient(REMOTE_ADDR=ip)
    bad.credentials(HTTP_AUTHORIZATION="Bearer dvb_000000000000_guess")
    for _ in range(3):
        assert bad.get("/api/v1/me/").status_code == 401
    response = bad.get("/api/v1/me/")
    assert response.status_code == 429
    assert error_of(response)["code"] == "throttled"
    assert 1 <= int(response["Retry-After"]) <= 3600
    # Past the limit even a valid key from that address waits; other addresses do not.
    same = APIClient(REMOTE_ADDR=ip)
    same.credentials(HTTP_AUTHORIZATION=f"Bearer {good}")
    assert same.get("/api/v1/me/").status_code == 429
    other = APIClient(REMOTE_ADDR=fresh_ip())
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {good}")
    assert other.get("/api/v1/me/").status_code == 200


def test_upload_endpoints_are_limited_per_user(world: World, api: Api, settings: Any) -> None:
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "uploads": "3/hour"}
    # User ids restart with each test database, and the counters (Redis, or the shared
    # file cache) outlive it and are seen by parallel test processes: a fresh key.
    cache.delete(FixedWindow("uploads", f"user:{world.admin.pk}").key)
    client = api("admin")
    body = {"experiment": "acme/run-1", "kind": "artifact", "size": 5, "sha256": sha256(b"hello")}
    statuses = [client.post("/api/v1/uploads/", body, format="json").status_code for _ in range(4)]
    assert statuses == [201, 201, 201, 429]
    response = client.post("/api/v1/uploads/", body, format="json")
    assert error_of(response)["code"] == "throttled"
    assert int(response["Retry-After"]) >= 1
    # Reads are not limited (a client resuming an upload asks for its state), nor is
    # any other endpoint, nor another user.
    assert client.get("/api/v1/uploads/").status_code == 200
    assert client.get("/api/v1/experiments/").status_code == 200
    assert api("alice").post("/api/v1/uploads/", body, format="json").status_code == 201


def test_without_redis_every_worker_process_shares_the_counters(tmp_path: Any) -> None:
    # Gunicorn runs several worker processes. Process-local counters would let each worker
    # count alone (a limit of 10 becomes 10 per worker); the embedded default's cache is
    # files with an flock (attestations/core/cache.py), so four processes hitting one counter
    # at once must add up exactly.
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DVBENCH_", "DJANGO_"))}
    for name in ("REDIS_URL", "DATABASE_URL"):
        environment.pop(name, None)
    environment.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DVBENCH_DATA_DIR=str(tmp_path),
        DVBENCH_RATE_UPLOADS="1000000/day",
    )
    hits = 150
    code = (
        "import django; django.setup(); from attestations.http.throttling import FixedWindow; "
        f"[FixedWindow('uploads', 'shared').hit() for _ in range({hits})]"
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=environment) for _ in range(4)
    ]
    assert [worker.wait(timeout=120) for worker in workers] == [0, 0, 0, 0]
    read = (
        "import django; django.setup(); from django.conf import settings; "
        "from django.core.cache import cache; from attestations.http.throttling import FixedWindow; "
        "print(settings.CACHES['default']['BACKEND'], cache.get(FixedWindow('uploads', 'shared').key))"
    )
    result = subprocess.run(
        [sys.executable, "-c", read], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    backend, count = result.stdout.split()
    assert backend == "attestations.core.cache.SharedFileCache"
    assert int(count) == 4 * hits


# --- API keys -----------------------------------------------------------------------------


def test_api_keys_are_stored_as_sha256_only(world: World, api: Api) -> None:
    raw = sudo_session(world, "alice").post("/api/v1/keys/", {"name": "k"}, format="json")
    raw = raw.json()["key"]
    key = ApiKey.objects.get(name="k")
    stored = [str(getattr(key, f.attname)) for f in ApiKey._meta.concrete_fields]
    assert not any(raw in value or value in raw for value in stored if len(value) > 16)
    assert key.digest == sha256(raw.encode())


def test_api_keys_are_compared_in_constant_time(world: World, monkeypatch: Any) -> None:
    import hmac

    from attestations.accounts.models import api_keys
    from attestations.http import authentication

    _, raw = ApiKey.issue(world.alice, "k")
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    # Both the model's check and the request path's (attestations/http/authentication.py).
    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    monkeypatch.setattr(authentication.hmac, "compare_digest", spy)
    forged = raw[:-1] + ("A" if raw[-1] != "A" else "B")
    assert ApiKey.authenticate(forged) is None
    assert ApiKey.authenticate(raw) is not None
    for key, status in ((forged, 401), (raw, 200)):
        client = APIClient(REMOTE_ADDR=fresh_ip())
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        assert client.get("/api/v1/me/").status_code == status
    # Every outcome went through the constant-time comparison of the 64-hex digests.
    assert [len(a) for a, _ in compared] == [64, 64, 64, 64]


# --- Audit trail --------------------------------------------------------------------------


def test_every_privileged_api_action_is_audited(world: World, api: Api) -> None:
    admin, alice = api("admin"), api("alice")
    session = sudo_session(world, "alice")
    before = AuditEvent.objects.count()
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("api_key.created", lambda: session.post("/api/v1/keys/", {"name": "x"}, format="json")),
        (
            "api_key.revoked",
            lambda: alice.post(f"/api/v1/keys/{ApiKey.objects.get(name='x').pk}/revoke/"),
        ),
        (
            "invitation.created",
            lambda: admin.post(
                "/api/v1/organizations/acme/invitations/",
                {"username": "mallory", "role": "auditor"},
                format="json",
            ),
        ),
        (
            "membership.changed",
            lambda: admin.post(
                "/api/v1/organizations/acme/members/",
                {"username": "bob", "role": "trainer"},
                format="json",
            ),
        ),
        ("membership.removed", lambda: admin.delete("/api/v1/organizations/acme/members/bob/")),
        (
            "experiment.registered",
            lambda: alice.post(
                "/api/v1/experiments/",
                {
                    "owner": "acme",
                    "name": "audited",
                    "spec": world.experiment.current_spec.to_dict(),
                },
                format="json",
            ),
        ),
        ("upload.created", lambda: open_upload(alice, b"hello")),
        ("upload.aborted", lambda: alice.post(f"/api/v1/uploads/{world.upload.id}/abort/")),
        ("upload.completed", lambda: upload_blob(alice, b"some artifact bytes")),
    ]
    for action, step in steps:
        count = AuditEvent.objects.count()
        response = step()
        status = response.status_code if hasattr(response, "status_code") else 201
        assert status < 400, (action, getattr(response, "content", response))
        new = AuditEvent.objects.order_by("-id")[: AuditEvent.objects.count() - count]
        assert any(e.action.startswith(action) for e in new), (action, [e.action for e in new])
        assert all(e.actor_name in ("alice", "admin") for e in new)
    assert AuditEvent.objects.count() > before


# --- No secret in logs --------------------------------------------------------------------


def test_no_api_key_or_password_reaches_the_logs(
    world: World, api: Api, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    # Before the limits below: the counters of alice's failures outlive a run.
    session = sudo_session(world, "alice")
    settings.DVBENCH_RATE_LIMITS = {
        **settings.DVBENCH_RATE_LIMITS,
        "login_failures": "2/hour",
        "api_key_failures": "2/hour",
    }
    ip = fresh_ip()
    created = session.post("/api/v1/keys/", {"name": "logged?"}, format="json").json()["key"]
    client = APIClient(REMOTE_ADDR=ip)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created}")
    client.get("/api/v1/me/")
    client.get("/api/v1/no-such-endpoint/")
    client.post("/api/v1/uploads/", {"experiment": "acme/run-1", "kind": "x"}, format="json")
    wrong = created[:-4] + "AAAA"
    bad = APIClient(REMOTE_ADDR=ip)
    bad.credentials(HTTP_AUTHORIZATION=f"Bearer {wrong}")
    for _ in range(4):  # past the limit: the refusal is logged too
        bad.get("/api/v1/me/")
    secret_password = "Tr0ub4dor&3-not-logged"
    web = Client(REMOTE_ADDR=ip)
    for _ in range(4):
        web.post("/login/", {"username": "alice", "password": secret_password})
    web.post("/login/", {"username": "alice", "password": PASSWORD})
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert caplog.records, "nothing was logged: the capture is not working"
    # The key is dvb_<lookup>_<secret>, and the secret (token_urlsafe) may itself hold
    # "_": split after the lookup, not at the last "_" (which once left the one-letter
    # tail "M", found in "Too Many Requests").
    prefix, lookup, secret_part = created.split("_", 2)
    assert prefix == "dvb" and len(lookup) == 12 and len(secret_part) >= 40
    for secret in (created, secret_part, wrong, secret_password, PASSWORD):
        assert secret not in text
