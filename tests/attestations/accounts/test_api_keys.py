"""Personal API keys: hashed at rest, shown once, expiring, revocable, last use recorded."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey
from attestations.audit.models import AuditEvent
from tests.attestations.base import World, error_of, sudo_session

Api = Callable[[str | None], APIClient]


def bearer(raw: str, scheme: str = "Bearer") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {raw}")
    return client


def test_it_is_shown_once_and_stored_hashed(world: World, api: Api) -> None:
    response = sudo_session(world, "alice").post("/api/v1/keys/", {"name": "laptop"}, format="json")
    assert response.status_code == 201
    raw = response.json()["key"]
    assert raw.startswith("dvb_") and len(raw) > 50
    key = ApiKey.objects.get(pk=response.json()["id"])
    assert key.digest == hashlib.sha256(raw.encode()).hexdigest()
    assert raw not in str(ApiKey.objects.filter(pk=key.pk).values().get())
    listed = api("alice").get("/api/v1/keys/").json()["results"]
    assert all("key" not in item for item in listed)
    assert bearer(raw).get("/api/v1/me/").json()["username"] == "alice"
    assert AuditEvent.objects.filter(action="api_key.created", target_id=str(key.pk)).exists()


def test_the_api_key_scheme_is_accepted(world: World) -> None:
    _, raw = ApiKey.issue(world.alice, "x")
    assert bearer(raw, "Api-Key").get("/api/v1/me/").status_code == 200


def test_it_expires(world: World) -> None:
    key, raw = ApiKey.issue(world.alice, "short", days=1)
    ApiKey.objects.filter(pk=key.pk).update(expires=timezone.now() - timedelta(seconds=1))
    response = bearer(raw).get("/api/v1/me/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_it_can_be_revoked(world: World, api: Api) -> None:
    key, raw = ApiKey.issue(world.alice, "ci")
    assert bearer(raw).get("/api/v1/me/").status_code == 200
    assert api("alice").post(f"/api/v1/keys/{key.pk}/revoke/").status_code == 200
    assert bearer(raw).get("/api/v1/me/").status_code == 401
    assert AuditEvent.objects.filter(action="api_key.revoked", target_id=str(key.pk)).count() == 1


def test_it_validates_ownership(world: World, api: Api) -> None:
    key, raw = ApiKey.issue(world.alice, "ci")
    assert api("mallory").post(f"/api/v1/keys/{key.pk}/revoke/").status_code == 404
    assert api("bob").get(f"/api/v1/keys/{key.pk}/").status_code == 404
    assert bearer(raw).get("/api/v1/me/").status_code == 200


def test_a_forged_key_with_a_real_lookup_fails(world: World) -> None:
    _key, raw = ApiKey.issue(world.alice, "ci")
    forged = raw[:-4] + ("AAAA" if not raw.endswith("AAAA") else "BBBB")
    assert bearer(forged).get("/api/v1/me/").status_code == 401


def test_last_used_is_recorded(world: World) -> None:
    key, raw = ApiKey.issue(world.alice, "ci")
    assert key.last_used is None
    bearer(raw).get("/api/v1/me/")
    key.refresh_from_db()
    assert key.last_used is not None
