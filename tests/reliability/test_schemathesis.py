"""Schemathesis against the platform's own OpenAPI schema: no operation answers 5xx.

The schema is loaded from ``/api/v1/schema/`` of the Django WSGI application itself, so an
endpoint added later is fuzzed without this file changing. Every operation gets
schema-conforming cases (positive) and schema-violating ones (negative), sent in-process
through the whole middleware stack with an admin's API key (the widest set of permissions
in one organisation). Each response must be below 500, and an error under ``/api/v1/``
must be in the one error format.

Budget: ``DVBENCH_FUZZ_EXAMPLES`` cases per operation and mode, scaled down here since
there are dozens of operations (see ``tests/reliability/fuzz.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import given
from hypothesis.errors import Unsatisfiable
from rest_framework.test import APIClient

from attestations.models import ApiKey
from tests.attestations.base import World
from tests.reliability.fuzz import budget

Api = Callable[[str | None], APIClient]


@pytest.fixture
def keep_test_connection() -> Iterator[None]:
    """Keep the test's database connection open across in-process WSGI requests.

    Django closes "old" connections when a request starts and ends; inside a test's
    transaction that closes the test's own connection. Django's test client suspends
    this for its requests; requests through the plain WSGI handler need the same.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def check_response(case: Any, response: Any) -> None:
    status = response.status_code
    where = f"{case.method} {case.formatted_path}"
    assert status < 500, f"{where} -> {status}: {response.content[:600]!r}"
    if status >= 400 and case.formatted_path.startswith("/api/v1/"):
        content_type = response.headers.get("content-type", [""])[0]
        assert content_type.startswith("application/json"), (where, status, response.content[:300])
        body = json.loads(response.content)
        assert set(body) == {"error", "request_id"}, (where, body)
        assert body["error"]["code"] and body["error"]["message"], (where, body)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_operation_answers_a_server_error(
    world: World, mode: str, keep_test_connection: None, settings: Any
) -> None:
    # Negative cases include bad credentials; the limits would turn them into 429s.
    settings.DVBENCH_RATE_LIMITS = dict.fromkeys(settings.DVBENCH_RATE_LIMITS)
    _, raw = ApiKey.issue(world.admin, "schemathesis")
    headers = {"Authorization": f"Bearer {raw}"}
    app = get_wsgi_application()
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/", app, headers=headers)
    generation = (
        schemathesis.GenerationMode.POSITIVE
        if mode == "positive"
        else schemathesis.GenerationMode.NEGATIVE
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, "the schema lost its operations"
    exercised = 0
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=generation)

        @budget(0.25)
        @given(case=strategy)
        def run(case: Any) -> None:
            # The admin's key, whatever headers the case carries (a negative case may
            # corrupt its own; we want the endpoint behind authentication exercised).
            response = case.call(headers=headers)
            check_response(case, response)

        try:
            run()
        except Unsatisfiable:
            continue  # no schema-violating input exists for this operation
        exercised += 1
    assert exercised >= len(operations) // 2


@pytest.mark.parametrize(
    "path",
    [
        # PostgreSQL refuses NUL in text and UTC offsets beyond 15:59 that Python accepts.
        "/api/v1/audit-events/?action=a%00b",
        "/api/v1/experiments/?owner=%00",
        "/api/v1/proofs/?experiment=acme/x%00",
        "/api/v1/experiments/?created_after=8902-08-26T05:00:13-20:11",  # now a valid query
        "/api/v1/experiments/?created_before=9999-12-31T23:59:59-23:00",
        # Digits that are not ASCII; a malformed UUID the URL pattern lets through.
        "/api/v1/jobs/?proof=%D9%A1",
        "/api/v1/uploads/38e965018-91c69-02300156-7e7e736a5bb/",
        # A newline in a path segment matches no route, not even the catch-all.
        "/api/v1/organizations/%0A/members/",
    ],
)
def test_what_fuzzing_found_stays_fixed(world: World, api: Api, path: str) -> None:
    response = api("admin").get(path)
    assert response.status_code < 500, (response.status_code, response.content[:300])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error", "request_id"} and body["error"]["message"]


def test_a_nul_in_a_related_lookup_is_a_400(world: World, api: Api) -> None:
    # DRF's slug-related field passes the value to the database, which refuses NUL.
    body = {"owner": "ac\x00me", "name": "x", "spec": world.experiment.current_spec.to_dict()}
    response = api("admin").post("/api/v1/experiments/", body, format="json")
    assert response.status_code == 400, response.content
    # PostgreSQL refuses the value (invalid_value); SQLite finds no such owner.
    assert response.json()["error"]["code"] in ("invalid_value", "does_not_exist")
