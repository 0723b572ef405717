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
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import given
from hypothesis.errors import Unsatisfiable
from rest_framework.test import APIClient

from attestations.models import ApiKey
from tests.attestations.base import World
from tests.reliability.fuzz import budget

Api = Callable[[str | None], APIClient]


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
def test_no_operation_answers_a_server_error(world: World, mode: str) -> None:
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
