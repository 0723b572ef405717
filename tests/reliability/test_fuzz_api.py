"""Hostile values where every API operation takes them: a 4xx in the one error format.

Three classes of input the platform answered with a 500 (issue 22), each driven from the
OpenAPI schema so that an endpoint added later is covered without this file changing:

* **deep nesting**: JSON bodies nested up to 100,000 levels (arrays, objects, both), as
  the whole body and as the value of each of the operation's body fields (``spec``,
  ``window``, ``files``...), built as text because ``json.dumps`` itself would recurse;
* **integers past 2^63** (and below -2^63, and 40-digit ones) in every integer query and
  path parameter of every operation (SQLite cannot bind them: ``OverflowError``);
* **forged cursors** for every paginated list: base64 of ``p=<anything>&o=<n>&r=<n>``,
  not-base64, not-ASCII, huge offsets.

Each request goes through the whole middleware stack with an admin's key (and the
cursor property also with a regulator's). The contract: a status below 500, and every
4xx in the one error format with a code and a message.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey
from attestations.http.parsers import MAX_DEPTH, nesting_depth
from tests.attestations.base import World, error_of, sudo_session
from tests.reliability.fuzz import budget

Api = Callable[[str | None], APIClient]
METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    from django.test import Client

    response = Client().get("/api/v1/schema/", {"format": "json"})
    assert response.status_code == 200
    return json.loads(response.content)


def _operations(schema: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in schema["paths"].items():
        for method in METHODS:
            if method in item:
                yield method, path, item[method]


def _fill(path: str, world: World, **override: str) -> str:
    """A path of the world: its proof, job, upload; acme's experiment; admin's key."""
    known = {
        "id": str(world.proof.pk),
        "owner": "acme",
        "name": "run-1",
        "slug": "acme",
        "username": "bob",
        "version": "1",
        "number": "1",
        "index": "0",
    }
    if path.startswith(("/api/v1/jobs/", "/api/v1/jobs")):
        known["id"] = str(world.job.pk)
    if path.startswith("/api/v1/uploads/"):
        known["id"] = str(world.upload.pk)
    known.update(override)
    return re.sub(r"\{(\w+)\}", lambda m: known.get(m.group(1), "1"), path)


def refused_clearly(response: Any, where: str) -> None:
    status = response.status_code
    assert status < 500, (where, status, response.content[:400])
    if status >= 400:
        error = error_of(response)
        assert error["code"] and error["message"], (where, error)


def _call(client: APIClient, method: str, url: str, body: str | None = None) -> Any:
    if body is None:
        return getattr(client, method)(url)
    return client.generic(method.upper(), url, body.encode(), content_type="application/json")


# --- deep nesting -----------------------------------------------------------------------


def nested(depth: int, shape: str) -> str:
    """JSON nested at least ``depth`` levels deep, as text (json.dumps would recurse)."""
    if shape == "array":
        return "[" * depth + "]" * depth
    if shape == "object":
        return '{"a":' * depth + "0" + "}" * depth
    pairs = (depth + 1) // 2  # an object and an array per pair
    return '{"a":[' * pairs + "1" + "]}" * pairs


depths = st.one_of(
    st.sampled_from([MAX_DEPTH + 1, 1000, 5000, 100_000]),
    st.integers(min_value=MAX_DEPTH + 1, max_value=3000),
)
shapes = st.sampled_from(["array", "object", "mixed"])


def _body_operations(schema: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(method, path, top-level body fields) of every operation with a JSON body."""
    found = []
    components = schema["components"]["schemas"]
    for method, path, operation in _operations(schema):
        content = operation.get("requestBody", {}).get("content", {})
        if "application/json" not in content:
            continue
        body = content["application/json"]["schema"]
        fields: set[str] = set()
        for branch in [body, *body.get("oneOf", [])]:
            ref = branch.get("$ref", "")
            target = components.get(ref.rsplit("/", 1)[-1], branch)
            for option in [target, *target.get("oneOf", [])]:
                option = components.get(option.get("$ref", "").rsplit("/", 1)[-1], option)
                fields |= set(option.get("properties", {}))
        found.append((method, path, sorted(fields)))
    return found


def test_every_json_operation_is_fuzzed(schema: dict[str, Any]) -> None:
    paths = {path for _, path, _ in _body_operations(schema)}
    assert {"/api/v1/experiments/", "/api/v1/proofs/{id}/data-queries/"} <= paths
    assert len(paths) >= 8


@pytest.mark.parametrize("actor", ["admin"])
def test_deep_nesting_anywhere_in_a_body_is_a_400(
    world: World, api: Api, schema: dict[str, Any], actor: str
) -> None:
    client = api(actor)
    # Creating keys (and confirming a password for it) is for a signed-in session in sudo
    # mode, never for a key (issue 34): those bodies are sent by such a session.
    session = sudo_session(world, actor)
    operations = _body_operations(schema)

    @budget(0.5)
    @given(
        which=st.integers(min_value=0, max_value=len(operations) - 1),
        depth=depths,
        shape=shapes,
        where=st.integers(min_value=-1, max_value=20),
    )
    def run(which: int, depth: int, shape: str, where: int) -> None:
        method, path, fields = operations[which]
        deep = nested(depth, shape)
        if where < 0 or not fields:
            body = deep
        else:
            # The deep value as one field of an otherwise ordinary body.
            body = '{"' + fields[where % len(fields)] + '":' + deep + "}"
        caller = session if path.startswith("/api/v1/keys/") and method == "post" else client
        response = _call(caller, method, _fill(path, world), body)
        where_ = f"{method.upper()} {path} depth {depth} {shape}"
        refused_clearly(response, where_)
        assert response.status_code == 400, (where_, response.content[:300])
        assert error_of(response)["code"] == "too_deep", (where_, response.content[:300])

    run()


def test_nesting_within_the_limit_is_judged_on_its_merits(world: World, api: Api) -> None:
    # MAX_DEPTH levels pass the parser and reach validation, which names the field.
    assert nesting_depth(json.loads(nested(MAX_DEPTH - 1, "array"))) == MAX_DEPTH - 1
    for shape in ("array", "object", "mixed"):
        assert nesting_depth(json.loads(nested(MAX_DEPTH + 1, shape))) >= MAX_DEPTH + 1
    body = '{"spec":' + nested(MAX_DEPTH - 1, "array") + ',"name":"acme/deep"}'
    response = _call(api("admin"), "post", "/api/v1/experiments/", body)
    assert response.status_code == 400
    assert error_of(response)["field"].startswith("spec")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # The report's two: a spec and a data-query window of 100,000 nested '['.
        ("/api/v1/experiments/", '{"name":"acme/x","spec":' + nested(100_000, "array") + "}"),
        ("/api/v1/proofs/{proof}/data-queries/", '{"window":' + nested(100_000, "array") + "}"),
    ],
)
def test_the_reported_deep_bodies_are_a_400(world: World, api: Api, path: str, body: str) -> None:
    response = _call(api("admin"), "post", path.format(proof=world.proof.pk), body)
    assert response.status_code == 400, response.content[:300]
    assert error_of(response)["code"] == "too_deep"


# --- integers past 2^63 -----------------------------------------------------------------


def _integer_parameters(schema: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(method, path, location, name) of every integer query or path parameter."""
    found = []
    for method, path, operation in _operations(schema):
        for parameter in operation.get("parameters", []):
            if parameter.get("in") in ("query", "path") and (
                parameter.get("schema", {}).get("type") == "integer"
            ):
                found.append((method, path, parameter["in"], parameter["name"]))
    return found


huge = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=2**64, max_value=10**60),
    st.integers(max_value=-(2**63) + 1, min_value=-(10**40)),
    st.sampled_from([2**63, 2**63 - 1, 2**64, -(2**63) - 1, 10**40, 10**40 - 1]),
).map(str)


def test_every_integer_parameter_is_fuzzed(schema: dict[str, Any]) -> None:
    names = {name for _, _, _, name in _integer_parameters(schema)}
    # Filters, pagination, log positions, path ids: all of them are in the schema.
    assert {"proof", "page_size", "flops_min", "declared_flops_at_least", "index", "first"} <= names
    assert {"id", "version", "number"} <= names


#: Filters on 40-digit decimal columns (FLOPs, tokens): whole numbers up to 10**40 - 1.
DECIMAL_40_FILTERS = (
    "flops_min",
    "flops_max",
    "tokens_min",
    "tokens_max",
    "lineage_flops_min",
    "lineage_flops_max",
    "declared_flops_at_least",
)


def test_integers_past_64_bits_in_any_parameter_are_a_4xx(
    world: World, api: Api, schema: dict[str, Any]
) -> None:
    client = api("admin")
    parameters = _integer_parameters(schema)

    @budget(1.0)
    @given(which=st.integers(min_value=0, max_value=len(parameters) - 1), value=huge)
    def run(which: int, value: str) -> None:
        method, path, location, name = parameters[which]
        if location == "path":
            url = _fill(path, world, **{name: value})
        else:
            url = f"{_fill(path, world)}?{name}={value}"
        response = client.get(url) if method == "get" else _call(client, method, url, "{}")
        where = f"{method.upper()} {url}"
        refused_clearly(response, where)
        # Within the column's range it may be a valid query; past it never.
        if abs(int(value)) > 2**63 - 1 and name not in DECIMAL_40_FILTERS:
            assert response.status_code >= 400, (where, response.content[:300])

    run()


# --- forged cursors ---------------------------------------------------------------------


def _paginated(schema: dict[str, Any]) -> list[str]:
    paths = []
    for method, path, operation in _operations(schema):
        names = {p["name"] for p in operation.get("parameters", [])}
        if method == "get" and "cursor" in names:
            paths.append(path)
    return paths


def b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8", "surrogatepass")).decode("ascii")


positions = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["foo", "", "9" * 30, str(2**63), "-1", "2026-13-45 99:00:00", "nan"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.datetimes().map(str),
)
forged = st.one_of(
    st.builds(
        lambda p, o, r: b64(f"p={p}&o={o}&r={r}"),
        positions,
        st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str), st.text(max_size=5)),
        st.one_of(st.sampled_from(["0", "1"]), st.text(max_size=5)),
    ),
    positions.map(b64),
    st.text(max_size=60),
    st.sampled_from(["cD1mb28=", "%%%", "cD1mb28", "p=foo", "\u00e9t\u00e9", "cj0x"]),
)


def test_every_list_is_paginated_and_fuzzed(schema: dict[str, Any]) -> None:
    paths = set(_paginated(schema))
    assert {"/api/v1/proofs/", "/api/v1/proofs/{id}/challenges/", "/api/v1/certificates/"} <= paths


@pytest.mark.parametrize("actor", ["admin", "carol"])
def test_a_forged_cursor_on_any_list_is_a_4xx(
    world: World, api: Api, schema: dict[str, Any], actor: str
) -> None:
    client = api(actor)
    paths = _paginated(schema)

    @budget(1.0)
    @given(which=st.integers(min_value=0, max_value=len(paths) - 1), cursor=forged)
    def run(which: int, cursor: str) -> None:
        url = _fill(paths[which], world)
        response = client.get(url, {"cursor": cursor})
        refused_clearly(response, f"GET {url} cursor={cursor!r}")

    run()


def test_the_cursors_the_api_issues_still_work(world: World, api: Api) -> None:
    client = api("admin")
    for _ in range(3):
        ApiKey.issue(world.admin, "k")
    first = client.get("/api/v1/keys/", {"page_size": 2}).json()
    second = client.get(first["next"]).json()
    assert second["results"] and second["previous"]
    back = client.get(second["previous"]).json()
    assert [k["id"] for k in back["results"]] == [k["id"] for k in first["results"]]


@pytest.mark.parametrize(
    "hours", [1e300, -1e300, 1e11, -0.001, 99999999999.9995, 2**80, float("1e-300"), "1e5", "x"]
)
def test_gpu_hours_out_of_range_is_a_400(world: World, api: Api, hours: Any) -> None:
    # Found by schemathesis on PostgreSQL: 1e300 reached Decimal.quantize (InvalidOperation).
    spec = {**world.experiment.current_spec.to_dict(), "max_gpu_hours": hours}
    response = api("admin").post("/api/v1/experiments/acme/run-1/specs/", spec, format="json")
    assert response.status_code == 400, response.content[:300]
    assert error_of(response)["field"] == "max_gpu_hours"
