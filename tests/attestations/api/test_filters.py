"""Regulator-style queries: by organisation, declared compute, date; bad values name the parameter."""

from __future__ import annotations

from collections.abc import Callable

from django.utils import timezone
from rest_framework.test import APIClient

from attestations.experiments.models import Experiment
from attestations.proofs.models import Proof
from tests.attestations.base import SPEC, World, error_of

Api = Callable[[str | None], APIClient]


def ids(response: object) -> set[str]:
    return {item["id"] for item in response.json()["results"]}  # type: ignore[attr-defined]


def test_by_organisation_and_declared_compute(world: World, api: Api) -> None:
    Experiment.register(world.evil, "small", {**SPEC, "max_flops": 10**20}, user=world.mallory)
    carol = api("carol")
    assert ids(carol.get("/api/v1/experiments/?owner=evil")) == {"evil/heist", "evil/small"}
    big = ids(carol.get(f"/api/v1/experiments/?declared_flops_at_least={10**24}"))
    assert big == {"acme/run-1", "evil/heist"}


def test_by_date(world: World, api: Api) -> None:
    Experiment.objects.filter(pk=world.other.pk).update(
        created=timezone.now() - timezone.timedelta(days=30)
    )
    carol = api("carol")
    recent = ids(
        carol.get(
            f"/api/v1/experiments/?created_after={(timezone.now() - timezone.timedelta(days=1)).date()}"
        )
    )
    assert recent == {"acme/run-1"}
    old = ids(
        carol.get(
            "/api/v1/experiments/?created_before="
            + str((timezone.now() - timezone.timedelta(days=7)).date())
        )
    )
    assert old == {"evil/heist"}
    Proof.objects.filter(pk=world.proof.pk).update(verified=timezone.now())
    proofs = carol.get("/api/v1/proofs/?verified_after=2000-01-01T00:00:00Z").json()["results"]
    assert [p["id"] for p in proofs] == [world.proof.pk]


def test_bad_values_name_the_parameter(world: World, api: Api) -> None:
    for query, field in [
        ("declared_flops_at_least=1e25", "declared_flops_at_least"),
        ("created_after=yesterday", "created_after"),
        ("framework=tensorflow", "framework"),
    ]:
        response = api("carol").get(f"/api/v1/experiments/?{query}")
        assert response.status_code == 400, query
        error = error_of(response)
        assert (error["code"], error["field"]) == ("invalid_filter", field)


def test_every_filtered_list_refuses_an_unknown_parameter(world: World, api: Api) -> None:
    """A typo in a filter is a 400 naming it and the allowed ones, never every row."""
    for path, known in [
        ("/api/v1/experiments/", "owner"),
        ("/api/v1/proofs/", "status"),
        ("/api/v1/jobs/", "proof"),
        ("/api/v1/audit-events/", None),
        ("/api/v1/uploads/", None),
        (f"/api/v1/proofs/{world.proof.pk}/challenges/", "status"),
        ("/api/v1/certificates/", "flops_max"),
    ]:
        response = api("admin").get(path, {"ownr": "acme"})
        assert response.status_code == 400, (path, response.content[:300])
        error = error_of(response)
        assert (error["code"], error["field"]) == ("unknown_filter", "ownr"), path
        allowed = error["detail"]["allowed"]
        assert {"cursor", "page_size", "format"} <= set(allowed), path
        if known is not None:
            assert known in allowed, path
        assert api("admin").get(path, {"page_size": 1}).status_code == 200, path


def list_endpoints() -> list[str]:
    """Every GET of the API whose answer is a list (an array or a page), from the schema.

    The schema is generated from the URLconf, so a list added tomorrow is walked too.
    """
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    paths = []
    for path, operations in schema["paths"].items():
        content = operations.get("get", {}).get("responses", {}).get("200", {}).get("content")
        body = next(iter(content.values()), {}).get("schema", {}) if content else {}
        if body.get("type") == "array" or "Paginated" in body.get("$ref", ""):
            paths.append(path)
    return paths


def test_every_list_in_the_urlconf_refuses_an_unknown_parameter(world: World, api: Api) -> None:
    """No list lets a misspelt filter through: one walk over every list the API has."""
    values = {"{owner}": "acme", "{name}": "run-1", "{slug}": "acme", "{id}": str(world.proof.pk)}
    paths = list_endpoints()
    for listed in ("/sliced-runs/", "/members/", "/keys/", "/invitations/", "/specs/"):
        assert any(p.endswith(listed) for p in paths), (listed, paths)
    for template in paths:
        path = template
        for name, value in values.items():
            path = path.replace(name, value)
        assert "{" not in path, f"give {template}'s path parameter a value in this test"
        response = api("admin").get(path, {"ownr": "acme"})
        assert response.status_code == 400, (path, response.status_code, response.content[:300])
        error = error_of(response)
        assert (error["code"], error["field"]) == ("unknown_filter", "ownr"), path
        assert "format" in error["detail"]["allowed"], path
        # The same list without the stray parameter is served (the admin may read it).
        assert api("admin").get(path).status_code == 200, path
