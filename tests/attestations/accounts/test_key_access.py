"""An API key's request reads key, user and memberships in one query; Access is the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from attestations.accounts.models import Access, ApiKey, Membership, Role
from attestations.experiments.models import Experiment
from attestations.http.authentication import authenticate_key
from tests.attestations.base import World

Api = Callable[[str | None], APIClient]


def test_access_from_the_key_query_equals_access_from_the_database(world: World) -> None:
    # alice: one lab; carol: a regulator in an agency (reads all); a user in two labs; a
    # user in none.
    Membership.objects.create(user=world.alice, organization=world.evil, role=Role.AUDITOR)
    nobody = User.objects.create_user("nobody")
    for user in (world.alice, world.carol, world.mallory, nobody):
        _, raw = ApiKey.issue(user, "access")
        key = authenticate_key(raw)
        assert key is not None
        fresh = User.objects.get(pk=user.pk)  # no memberships attached: queries them
        assert Access.for_user(key.user) == Access.for_user(fresh), user.username
    assert Access.for_user(User.objects.get(pk=world.alice.pk)).roles == {
        world.acme.pk: Role.TRAINER,
        world.evil.pk: Role.AUDITOR,
    }


def test_a_list_request_by_key_is_two_queries(world: World, api: Api) -> None:
    client = api("alice")
    client.get("/api/v1/me/")  # the key's last_used write happens once
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/api/v1/experiments/")
    assert response.status_code == 200
    # The key with its user and memberships; the page with its proof counts.
    assert len(queries.captured_queries) == 2, [q["sql"][:80] for q in queries]


def test_the_per_request_reads_are_prepared_on_postgresql(world: World, api: Api) -> None:
    """The key lookup and the list's page are planned once per connection, not per request."""
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    client = api("alice")
    for _ in range(6):  # psycopg prepares a statement on its fifth run
        assert client.get("/api/v1/experiments/").status_code == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [statement for (statement,) in cursor.fetchall()]
    key_table, page_table = ApiKey._meta.db_table, Experiment._meta.db_table
    assert any(f'FROM "{key_table}" k' in statement for statement in prepared), prepared
    assert any(f'FROM "{page_table}"' in statement for statement in prepared), prepared


def test_a_membership_removed_takes_effect_on_the_next_request(world: World, api: Api) -> None:
    client = api("alice")
    assert client.get("/api/v1/experiments/acme/run-1/").status_code == 200
    Membership.objects.filter(user=world.alice, organization=world.acme).delete()
    # No membership left: the role check refuses before any experiment is looked up.
    assert client.get("/api/v1/experiments/acme/run-1/").status_code == 403
