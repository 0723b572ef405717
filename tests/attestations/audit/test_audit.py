"""The audit trail is append-only and records who did what."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from rest_framework.test import APIClient

from attestations.audit.models import AuditEvent
from attestations.core.db import AppendOnlyError
from tests.attestations.base import SPEC, World, make_user

Api = Callable[[str | None], APIClient]


def test_events_cannot_be_changed_or_deleted(world: World) -> None:
    event = AuditEvent.record("test.thing", actor=world.alice, organization=world.acme)
    event.action = "test.other"
    with pytest.raises(AppendOnlyError):
        event.save()
    with pytest.raises(AppendOnlyError):
        event.delete()
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.filter(pk=event.pk).update(action="x")
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.all().delete()
    assert AuditEvent.objects.get(pk=event.pk).action == "test.thing"


@pytest.mark.services
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE attestations_auditevent SET action = 'rewritten' WHERE id = %s",
        "UPDATE attestations_auditevent SET actor_name = '' WHERE id = %s",
        "DELETE FROM attestations_auditevent WHERE id = %s",
    ],
)
def test_raw_sql_cannot_change_or_delete_events_on_postgresql(world: World, sql: str) -> None:
    """The Python guard is not the only one: a shell's raw SQL is refused by a trigger."""
    if connection.vendor != "postgresql":
        pytest.skip("the append-only trigger exists on PostgreSQL only")
    event = AuditEvent.record("test.thing", actor=world.alice, organization=world.acme)
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(sql, [event.pk])
    stored = AuditEvent.objects.get(pk=event.pk)
    assert (stored.action, stored.actor_name) == ("test.thing", world.alice.username)


@pytest.mark.services
def test_deleting_a_user_unlinks_their_events_and_keeps_them(world: World) -> None:
    """``on_delete=SET_NULL`` is the one update the trigger allows; the name stays."""
    if connection.vendor != "postgresql":
        pytest.skip("the append-only trigger exists on PostgreSQL only")
    leaver = User.objects.create_user("leaver", password="x" * 20)
    event = AuditEvent.record("test.thing", actor=leaver, organization=world.acme)
    leaver.delete()
    stored = AuditEvent.objects.get(pk=event.pk)
    assert (stored.actor_id, stored.actor_name, stored.action) == (None, "leaver", "test.thing")
    # Unlinking is no cover for a rewrite: clearing the actor while editing is refused.
    other = AuditEvent.record("test.other", actor=world.alice)
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE attestations_auditevent SET actor_id = NULL, action = 'x' WHERE id = %s",
            [other.pk],
        )
    assert AuditEvent.objects.get(pk=other.pk).action == "test.other"


def test_actions_are_recorded_with_actor_and_ip(world: World, api: Api) -> None:
    api("alice").post("/api/v1/experiments/", {"name": "acme/run-2", "spec": SPEC}, format="json")
    world.users["dave"] = make_user("dave")
    invited = api("admin").post(
        "/api/v1/organizations/acme/invitations/",
        {"username": "dave", "role": "auditor"},
        format="json",
    )
    api("dave").post(f"/api/v1/invitations/{invited.json()['id']}/accept/")
    api("admin").post(
        "/api/v1/organizations/acme/members/", {"username": "bob", "role": "trainer"}, format="json"
    )
    api("admin").delete("/api/v1/organizations/acme/members/bob/")
    events = {e.action: e for e in AuditEvent.objects.filter(organization=world.acme)}
    assert {
        "experiment.registered",
        "invitation.created",
        "invitation.accepted",
        "membership.added",
        "membership.changed",
        "membership.removed",
    } <= set(events)
    assert events["invitation.created"].actor_name == "admin"
    # The invitee joins by their own act; the event says who invited them.
    assert events["membership.added"].actor_name == "dave"
    assert events["membership.added"].detail["invited_by"] == "admin"
    registered = AuditEvent.objects.get(
        action="experiment.registered", detail__experiment="acme/run-2"
    )
    assert registered.actor_name == "alice"
    assert registered.ip == "127.0.0.1"
    assert registered.detail["experiment"] == "acme/run-2"


def test_the_api_lists_and_filters_events(world: World, api: Api) -> None:
    api("alice").post("/api/v1/experiments/", {"name": "acme/run-2", "spec": SPEC}, format="json")
    body = api("bob").get("/api/v1/audit-events/?action=experiment.registered").json()
    # The world's acme/run-1 and the new acme/run-2; mallory's evil/heist is out of scope.
    assert [e["detail"]["experiment"] for e in body["results"]] == ["acme/run-2", "acme/run-1"]
    assert {e["action"] for e in body["results"]} == {"experiment.registered"}
    assert body["results"][0]["actor"] == "alice"


def test_cursor_pagination(world: World, api: Api) -> None:
    for index in range(5):
        AuditEvent.record(f"test.{index}", organization=world.acme)
    client = api("alice")
    first = client.get("/api/v1/audit-events/?page_size=2").json()
    assert len(first["results"]) == 2 and first["next"]
    second = client.get(first["next"]).json()
    assert {e["id"] for e in first["results"]}.isdisjoint({e["id"] for e in second["results"]})
