"""Who reads certificates, bundles and the log, and the regulator's certificate search.

Members of a proof's organisation read its certificate and bundle; regulators (carol)
read those of every organisation but never artifacts; outsiders (mallory) get 404, so
ids cannot be probed. The trust root and the log's hashes are public.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.certificates import keys
from attestations.certificates.models import Certificate
from attestations.proofs.models import ProofStatus
from dvbench.attest import TrustRoot, verify_bundle
from tests.attestations.base import World, error_of
from tests.attestations.certificate_helpers import certify, new_proof

Api = Callable[[str | None], APIClient]
ACTORS = ("alice", "bob", "carol", "mallory", "admin", None)


def codes(
    alice: int, bob: int, carol: int, mallory: int, admin: int, anon: int
) -> dict[str | None, int]:
    return dict(zip(ACTORS, (alice, bob, carol, mallory, admin, anon), strict=True))


MEMBERS_AND_REGULATORS = codes(200, 200, 200, 404, 200, 401)
EVERYONE = codes(200, 200, 200, 200, 200, 200)

ENDPOINTS = [
    ("certificate", "/api/v1/proofs/{proof}/certificate/", MEMBERS_AND_REGULATORS),
    ("bundle", "/api/v1/proofs/{proof}/bundle/", MEMBERS_AND_REGULATORS),
    ("certificate detail", "/api/v1/certificates/{certificate}/", MEMBERS_AND_REGULATORS),
    ("log entry", "/api/v1/log/entries/{index}/", MEMBERS_AND_REGULATORS),
    ("certificate search", "/api/v1/certificates/", codes(200, 200, 200, 200, 200, 401)),
    ("trust root", "/api/v1/trust-root/", EVERYONE),
    ("trust root versions", "/api/v1/trust-root/versions/", EVERYONE),
    ("checkpoint", "/api/v1/log/checkpoint/", EVERYONE),
    ("inclusion", "/api/v1/log/proof/inclusion/?index={index}", EVERYONE),
    ("consistency", "/api/v1/log/proof/consistency/?first=0&second=1", EVERYONE),
    # Regulators read certificates, never the artifacts they are about.
    ("transcript", "/api/v1/proofs/{proof}/transcript/", codes(200, 403, 403, 404, 200, 401)),
]


@pytest.fixture
def certified(world: World) -> Certificate:
    return certify(world.proof)


@pytest.mark.parametrize("actor", ACTORS, ids=[a or "anonymous" for a in ACTORS])
@pytest.mark.parametrize(("name", "url", "expected"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_permission_matrix(
    certified: Certificate,
    api: Api,
    actor: str | None,
    name: str,
    url: str,
    expected: dict[str | None, int],
) -> None:
    path = url.format(proof=certified.proof_id, certificate=certified.pk, index=certified.log_index)
    response = api(actor).get(path)
    assert response.status_code == expected[actor], (name, actor, response.content[:300])
    if response.status_code >= 400:
        assert error_of(response)["code"]


def test_an_outsider_cannot_tell_a_certificate_from_a_missing_one(
    certified: Certificate, api: Api
) -> None:
    hidden = api("mallory").get(f"/api/v1/proofs/{certified.proof_id}/bundle/")
    missing = api("mallory").get("/api/v1/proofs/999999/bundle/")
    assert hidden.status_code == missing.status_code == 404
    assert error_of(hidden)["code"] == error_of(missing)["code"] == "not_found"


def test_a_proof_without_a_certificate_says_so(world: World, api: Api) -> None:
    response = api("bob").get(f"/api/v1/proofs/{world.proof.pk}/certificate/")
    assert response.status_code == 404
    error = error_of(response)
    assert error["code"] == "no_certificate"
    assert f"Proof {world.proof.pk} has no certificate yet" in error["message"]


def test_the_certificate_endpoint_returns_the_logged_envelope(
    certified: Certificate, api: Api
) -> None:
    body = api("carol").get(f"/api/v1/proofs/{certified.proof_id}/certificate/").json()
    assert body["envelope"] == certified.envelope
    assert body["organization"] == "acme" and body["result"] == "PASSED"
    assert body["log_index"] == 0 and body["trust_root_version"] == 1
    entry = api("carol").get("/api/v1/log/entries/0/").json()
    assert entry["envelope"] == body["envelope"] and entry["certificate"] == certified.pk


def test_the_bundle_from_the_api_verifies_offline(certified: Certificate, api: Api) -> None:
    response = api("carol").get(f"/api/v1/proofs/{certified.proof_id}/bundle/")
    assert response.status_code == 200
    assert "attachment" in response["Content-Disposition"]
    trust = api(None).get("/api/v1/trust-root/")
    root = TrustRoot.from_json(trust.content)
    assert trust["X-Trust-Root-Digest"] == f"sha256:{root.digest()}"
    assert trust["X-Trust-Root-Version"] == "1"
    result = verify_bundle(response.content, root)
    assert result.ok, result.summary()


def test_earlier_trust_root_versions_stay_published(certified: Certificate, api: Api) -> None:
    keys.rotate_key()
    client = api(None)
    latest = TrustRoot.from_json(client.get("/api/v1/trust-root/").content)
    first = TrustRoot.from_json(client.get("/api/v1/trust-root/?version=1").content)
    assert (latest.version, first.version) == (2, 1)
    assert latest.keys[0].keyid == first.keys[0].keyid and latest.keys[0].not_after is not None
    versions = client.get("/api/v1/trust-root/versions/").json()
    assert [(v["version"], v["digest"]) for v in versions] == [
        (2, latest.digest()),
        (1, first.digest()),
    ]
    assert client.get(versions[1]["url"]).content == first.to_json()
    assert client.get("/api/v1/trust-root/?version=3").status_code == 404
    bad = client.get("/api/v1/trust-root/?version=two")
    assert bad.status_code == 400 and error_of(bad)["field"] == "version"


# --- search -------------------------------------------------------------------------


@pytest.fixture
def many(world: World, monkeypatch: pytest.MonkeyPatch) -> dict[str, Certificate]:
    """Four certificates issued in four months: acme passed, acme failed, a long acme run, evil."""
    clock = {"now": datetime(2026, 1, 10, 12, tzinfo=UTC)}
    # The signing clock (certificates and checkpoints take their time from it).
    monkeypatch.setattr(keys, "now", lambda: clock["now"])
    issued: dict[str, Certificate] = {}
    for month, (name, proof) in enumerate(
        (
            ("passed", lambda: world.proof),
            ("failed", lambda: new_proof(world.experiment, status=ProofStatus.REJECTED, seed=1)),
            ("long", lambda: new_proof(world.experiment, seed=2, steps=8)),
            ("evil", lambda: new_proof(world.other, seed=3)),
        ),
        start=1,
    ):
        clock["now"] = datetime(2026, month, 10, 12, tzinfo=UTC)
        issued[name] = certify(proof())
    return issued


def _search(api: Api, actor: str, **query: Any) -> list[int]:
    response = api(actor).get("/api/v1/certificates/", query)
    assert response.status_code == 200, response.content
    return [item["id"] for item in response.json()["results"]]


def test_a_regulator_searches_every_organisation(many: dict[str, Certificate], api: Api) -> None:
    ids = {name: certificate.pk for name, certificate in many.items()}
    assert _search(api, "carol") == [ids["evil"], ids["long"], ids["failed"], ids["passed"]]
    assert _search(api, "carol", organization="evil") == [ids["evil"]]
    assert _search(api, "carol", result="FAILED") == [ids["failed"]]
    assert _search(api, "carol", issued_after="2026-02-01", issued_before="2026-04-01") == [
        ids["long"],
        ids["failed"],
    ]
    assert _search(api, "carol", issued_after="2026-03-10T12:00:00Z") == [ids["evil"], ids["long"]]
    flops = many["long"].flops
    assert flops is not None and flops > many["passed"].flops  # type: ignore[operator]
    assert _search(api, "carol", flops_min=int(flops)) == [ids["long"]]
    assert _search(api, "carol", flops_min=int(flops) + 1) == []


def test_members_search_their_own_organisation_only(many: dict[str, Certificate], api: Api) -> None:
    assert _search(api, "mallory") == [many["evil"].pk]
    assert _search(api, "mallory", organization="acme") == []
    assert set(_search(api, "bob")) == {many[n].pk for n in ("passed", "failed", "long")}


def test_search_is_cursor_paginated(many: dict[str, Certificate], api: Api) -> None:
    client = api("carol")
    seen: list[int] = []
    page = client.get("/api/v1/certificates/", {"page_size": 1}).json()
    while True:
        assert len(page["results"]) == 1
        seen.extend(item["id"] for item in page["results"])
        if page["next"] is None:
            break
        page = client.get(page["next"]).json()
    assert seen == _search(api, "carol")


def test_a_regulator_searches_by_compute_and_tokens_ranges(
    many: dict[str, Certificate], api: Api
) -> None:
    ids = {name: certificate.pk for name, certificate in many.items()}
    long, short = many["long"], many["passed"]
    assert long.flops is not None and short.flops is not None and long.flops > short.flops
    assert long.tokens is not None and short.tokens is not None and long.tokens > short.tokens
    # The columns repeat the signed claims.
    assert long.tokens == long.claim_value("tokens") and long.flops == long.claim_value("flops")
    everyone_but_long = [ids["evil"], ids["failed"], ids["passed"]]
    assert _search(api, "carol", flops_max=int(long.flops) - 1) == everyone_but_long
    assert _search(api, "carol", flops_max=int(long.flops)) == _search(api, "carol")
    assert _search(api, "carol", tokens_min=int(long.tokens)) == [ids["long"]]
    assert _search(api, "carol", tokens_max=int(long.tokens) - 1) == everyone_but_long
    assert _search(api, "carol", tokens_min=int(short.tokens), tokens_max=int(short.tokens)) == (
        everyone_but_long
    )
    assert _search(api, "carol", flops_min=int(long.flops), flops_max=int(long.flops)) == [
        ids["long"]
    ]
    body = api("carol").get("/api/v1/certificates/", {"tokens_min": 1}).json()["results"]
    assert {item["tokens"] for item in body} == {int(short.tokens), int(long.tokens)}


@pytest.mark.parametrize(
    "query",
    [
        {"foo": "bar"},
        # A misspelt filter used to return every certificate, as if it matched.
        {"flops_maximum": "1"},
        {"result": "PASSED", "Organization": "acme"},
        {"page": "2"},
    ],
)
def test_an_unknown_query_parameter_is_a_400_naming_the_allowed_ones(
    many: dict[str, Certificate], api: Api, query: dict[str, str]
) -> None:
    response = api("carol").get("/api/v1/certificates/", query)
    assert response.status_code == 400, response.content
    error = error_of(response)
    unknown = sorted(set(query) - {"result"})[0]
    assert (error["code"], error["field"]) == ("unknown_filter", unknown)
    allowed = error["detail"]["allowed"]
    assert {
        "organization",
        "experiment",
        "issued_after",
        "issued_before",
        "flops_min",
        "flops_max",
        "tokens_min",
        "tokens_max",
        "lineage_flops_min",
        "lineage_flops_max",
        "result",
        "below_threshold",
        "above_threshold",
        "cursor",
        "page_size",
        "format",
    } == set(allowed)
    assert error["message"] == (
        f"{unknown!r} is not a query parameter of this endpoint; allowed: {', '.join(allowed)}"
    )


def test_pagination_format_and_threshold_parameters_stay_allowed(
    many: dict[str, Certificate], api: Api
) -> None:
    client = api("carol")
    first = client.get("/api/v1/certificates/", {"page_size": "1", "format": "json"})
    assert first.status_code == 200, first.content
    following = client.get(first.json()["next"])
    assert following.status_code == 200 and len(following.json()["results"]) == 1
    threshold = client.get("/api/v1/certificates/", {"below_threshold": "eu-ai-act-gpai"})
    assert threshold.status_code == 200, threshold.content


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"result": "passed"}, "result"),
        ({"flops_min": "1e20"}, "flops_min"),
        ({"flops_max": "-1"}, "flops_max"),
        ({"tokens_min": "many"}, "tokens_min"),
        ({"tokens_max": ""}, "tokens_max"),
        ({"tokens_max": str(10**40)}, "tokens_max"),
        ({"issued_after": "yesterday"}, "issued_after"),
        ({"issued_before": "2026-13-01"}, "issued_before"),
    ],
)
def test_a_bad_search_filter_is_a_400_naming_it(
    world: World, api: Api, query: dict[str, str], field: str
) -> None:
    response = api("carol").get("/api/v1/certificates/", query)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("invalid_filter", field)
    assert error["message"].startswith(f"{field}: ")


def test_the_search_is_read_only(certified: Certificate, api: Api) -> None:
    assert api("carol").post("/api/v1/certificates/", {}, format="json").status_code in (403, 405)
    assert api("admin").delete(f"/api/v1/certificates/{certified.pk}/").status_code == 405


def test_the_openapi_schema_documents_the_certificate_api(world: World) -> None:
    schema = APIClient().get("/api/v1/schema/?format=json").json()
    search = schema["paths"]["/api/v1/certificates/"]["get"]
    assert {p["name"] for p in search["parameters"]} >= {
        "organization",
        "issued_after",
        "issued_before",
        "flops_min",
        "flops_max",
        "tokens_min",
        "tokens_max",
        "lineage_flops_min",
        "lineage_flops_max",
        "result",
        "below_threshold",
        "above_threshold",
        "cursor",
        "page_size",
    }
    kinds = {p["name"]: p["schema"] for p in search["parameters"]}
    for name in ("flops_min", "flops_max", "tokens_min", "tokens_max"):
        assert kinds[name] == {"type": "integer", "minimum": 0, "maximum": 10**40 - 1}, name
    assert kinds["issued_after"]["format"] == "date-time"
    certificate = schema["components"]["schemas"]["Certificate"]["properties"]
    assert {"tokens", "limit_violations"} <= set(certificate)
    for path in (
        "/api/v1/proofs/{id}/certificate/",
        "/api/v1/proofs/{id}/bundle/",
        "/api/v1/trust-root/",
        "/api/v1/log/checkpoint/",
        "/api/v1/log/entries/{index}/",
        "/api/v1/log/proof/inclusion/",
        "/api/v1/log/proof/consistency/",
    ):
        assert "get" in schema["paths"][path], path


def test_a_search_page_costs_the_same_queries_for_one_or_many_certificates(
    world: World, api: Api
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = api("carol")
    client.get("/api/v1/certificates/")  # authenticate once (last_used is written)
    certify(world.proof)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/api/v1/certificates/").status_code == 200
        return len(captured)

    one = queries()
    for seed in (1, 2, 3):
        certify(new_proof(world.other if seed % 2 else world.experiment, seed=seed))
    assert queries() == one


def test_pages_hold_every_certificate_once_when_many_share_a_second(world: World, api: Api) -> None:
    from tests.attestations.certificates.test_translog import _issue_many

    issued = {certificate.pk for certificate in _issue_many(world, 11)}
    client = api("carol")
    seen: list[int] = []
    page = client.get("/api/v1/certificates/", {"page_size": 3}).json()
    while True:
        seen.extend(item["id"] for item in page["results"])
        if page["next"] is None:
            break
        page = client.get(page["next"]).json()
    assert sorted(seen) == sorted(issued)
