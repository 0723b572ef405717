"""A run's compute added to its parent runs': declared in the spec, found by weights, signed
in the ``lineage`` claim, counted by the thresholds that include fine-tuning, searched by
regulators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

import dvbench
from attestations.certificates import issuance, translog
from attestations.certificates.claims import compute_claims
from attestations.certificates.models import Certificate
from attestations.certificates.subjects import lineage_claim
from attestations.experiments.models import Experiment
from dvbench.attest import Claim, Evidence
from tests.attestations.base import SPEC, World, error_of
from tests.attestations.certificate_helpers import SGD, certify, new_proof

pytestmark = pytest.mark.django_db

Api = Callable[[str | None], APIClient]


def _fine_tune(world: World, api: Api, parent: Certificate, name: str = "run-1-sft") -> Experiment:
    """Register ``acme/<name>`` through the API, declaring ``parent`` as its parent run."""
    spec = {**SPEC, "optimizer": SGD, "parent_transcript": parent.transcript_digest.upper()}
    response = api("alice").post(
        "/api/v1/experiments/", {"name": f"acme/{name}", "spec": spec}, format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["spec"]["parent_transcript"] == parent.transcript_digest
    return Experiment.objects.get(owner__slug="acme", name=name)


def _thresholds(settings: Any, flops: int) -> None:
    settings.DVBENCH = {
        **settings.DVBENCH,
        "REGULATORY_THRESHOLDS": [
            {"name": "run-limit", "flops": flops, "description": "", "counts": "run"},
            {"name": "lineage-limit", "flops": flops, "description": "", "counts": "lineage"},
        ],
    }


def test_a_declared_parent_s_compute_is_added_and_counted_against_lineage_thresholds(
    world: World, api: Api, settings: Any
) -> None:
    parent = certify(world.proof)
    child_experiment = _fine_tune(world, api, parent)
    child_proof = new_proof(child_experiment, seed=1)
    own = int(next(c.value for c in compute_claims(child_proof).claims if c.name == "flops"))
    assert parent.flops is not None and own > 0
    # Between either run's compute and the two together.
    _thresholds(settings, max(int(parent.flops), own) + 1)

    child = certify(child_proof)

    total = int(parent.flops) + own
    assert child.lineage_flops == total and child.flops == own
    assert child.claim_value("lineage") == {
        "flops": total,
        "runs": 2,
        "parent_transcript": parent.transcript_digest,
        "parent_certificate": parent.pk,
        "declared": True,
        "starts_from_parent": False,
    }
    rows = {row["name"]: row for row in child.claim_value("regulatory_thresholds")}
    assert rows["run-limit"]["counts"] == "run" and rows["run-limit"]["flops"] == own
    assert rows["run-limit"]["stays_below"] is True
    assert rows["lineage-limit"]["flops"] == total and rows["lineage-limit"]["stays_below"] is False
    # The link is only declared (the synthetic run starts from its own initialisation):
    # the figure is the trainer's word.
    claim = next(c for c in child.claims() if c["name"] == "lineage")
    assert claim["evidence"] == Evidence.REPORTED
    # The searchable column is checked against the signed claim like the others.
    assert translog.verify_log().problems == []

    carol = api("carol")  # a regulator
    above = carol.get("/api/v1/certificates/", {"above_threshold": "lineage-limit"}).json()
    assert [item["id"] for item in above["results"]] == [child.pk]
    assert (
        carol.get("/api/v1/certificates/", {"above_threshold": "run-limit"}).json()["results"] == []
    )
    ranged = carol.get("/api/v1/certificates/", {"lineage_flops_min": total}).json()
    assert [item["id"] for item in ranged["results"]] == [child.pk]
    detail = carol.get(f"/api/v1/certificates/{child.pk}/").json()
    assert detail["lineage_flops"] == total and detail["lineage"]["runs"] == 2


def test_a_chain_adds_up_one_signed_step_at_a_time(world: World, api: Api) -> None:
    base = certify(world.proof)
    sft = certify(new_proof(_fine_tune(world, api, base, "sft"), seed=1))
    rl = certify(new_proof(_fine_tune(world, api, sft, "rl"), seed=2))

    assert rl.claim_value("lineage")["runs"] == 3
    assert rl.lineage_flops == base.flops + (sft.flops or 0) + (rl.flops or 0)
    assert base.claim_value("lineage") == {
        "flops": int(base.flops or 0),
        "runs": 1,
        "parent_transcript": None,
        "parent_certificate": None,
        "declared": False,
        "starts_from_parent": None,
    }


def test_a_run_that_starts_from_a_certified_model_is_linked_by_its_weights(
    world: World,
) -> None:
    parent = certify(world.proof)
    child = new_proof(Experiment.register(world.acme, "undeclared", SPEC, user=None), seed=1)
    claims = compute_claims(child).claims
    own = next(c.value for c in claims if c.name == "flops")

    # The run's committed initial parameters are the parent's committed final ones, and
    # its spec declares no parent: found all the same, and the link is committed.
    claim = lineage_claim(child, claims, parent.final_parameter_root, "f" * 64)
    assert claim.value["parent_certificate"] == parent.pk and claim.value["declared"] is False
    assert claim.value["starts_from_parent"] is True
    assert claim.value["flops"] == int(parent.flops or 0) + own
    assert claim.evidence == Evidence.COMMITTED
    # Other initial weights: a run of its own.
    alone = lineage_claim(child, claims, "0" * 64, "f" * 64)
    assert alone.value["parent_certificate"] is None and alone.value["flops"] == own


def test_a_parent_must_be_a_certificate_the_registrant_can_read(world: World, api: Api) -> None:
    evil = certify(new_proof(world.other, seed=3))
    for digest in ("ab" * 32, evil.transcript_digest):
        response = api("alice").post(
            "/api/v1/experiments/",
            {"name": "acme/ft", "spec": {**SPEC, "parent_transcript": digest}},
            format="json",
        )
        assert response.status_code == 404, response.content
        error = error_of(response)
        assert error["code"] == "unknown_parent", error
        assert error["field"] == "spec.parent_transcript", error
        assert digest in error["message"]
    assert not Experiment.objects.filter(name="ft").exists()
    # A new spec version of an existing experiment: the same refusal, nothing changed.
    before = world.experiment.current_spec_id
    revised = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/",
        {**SPEC, "parent_transcript": evil.transcript_digest},
        format="json",
    )
    assert revised.status_code == 404, revised.content
    assert error_of(revised)["field"] == "parent_transcript"
    world.experiment.refresh_from_db()
    assert world.experiment.current_spec_id == before


def test_the_sdk_binds_the_digest_the_platform_computes(world: World, api: Api) -> None:
    parent = certify(world.proof)
    experiment = _fine_tune(world, api, parent)
    spec = experiment.current_spec
    assert spec is not None and spec.parent_transcript == parent.transcript_digest
    local = dvbench.spec_digest(
        experiment.full_name,
        {**SPEC, "optimizer": SGD, "parent_transcript": spec.parent_transcript},
    )
    assert local == spec.digest
    # Without a parent the document, and so every earlier digest, is what it was.
    assert "parent_transcript" not in dvbench.spec_document("acme/x", SPEC)


def test_the_spec_page_declares_a_parent_and_keeps_it_when_other_fields_change(
    world: World, api: Api, client: Client
) -> None:
    parent = certify(world.proof)
    evil = certify(new_proof(world.other, seed=3))
    client.force_login(world.alice)
    form = {**SPEC, "max_flops": "1000", "max_tokens": "", "max_gpu_hours": ""}
    page = "/experiments/acme/run-1/spec/"

    refused = client.post(page, {**form, "parent_transcript": evil.transcript_digest})
    assert refused.status_code == 200  # the form again, with the error
    assert "No certificate you can read" in refused.content.decode()

    saved = client.post(page, {**form, "parent_transcript": parent.transcript_digest.upper()})
    assert saved.status_code == 302
    world.experiment.refresh_from_db()
    spec = world.experiment.current_spec
    assert spec is not None and spec.parent_transcript == parent.transcript_digest
    # The form shows it, so saving another change keeps it.
    assert parent.transcript_digest in client.get(page).content.decode()
    form["parent_transcript"] = parent.transcript_digest
    assert client.post(page, {**form, "max_flops": "2000"}).status_code == 302
    world.experiment.refresh_from_db()
    assert world.experiment.current_spec.parent_transcript == parent.transcript_digest


def test_another_lab_s_run_is_never_named_by_weights(world: World) -> None:
    theirs = certify(new_proof(world.other, seed=3))
    child = new_proof(Experiment.register(world.acme, "lookalike", SPEC, user=None), seed=1)
    claims = compute_claims(child).claims
    claim = lineage_claim(child, claims, theirs.final_parameter_root, "f" * 64)
    assert claim.value["parent_certificate"] is None and claim.value["runs"] == 1


@pytest.mark.parametrize(
    ("regime", "parent", "starts", "caught"),
    [
        ("pretraining", 7, True, "its initial parameters are the final parameters of"),
        ("pretraining", 7, False, "its spec declares as its parent"),
        ("fine-tuning", 7, True, None),
        ("pretraining", None, None, None),
        (None, 7, True, None),
    ],
)
def test_a_continuation_declared_as_pretraining_breaks_the_regime(
    regime: str | None, parent: int | None, starts: bool | None, caught: str | None
) -> None:
    claims = (Claim("regime", {"declared_by_trainer": regime, "allowed": []}, Evidence.REPORTED),)
    lineage = Claim(
        "lineage",
        {
            "parent_certificate": parent,
            "parent_transcript": "ab" * 32,
            "starts_from_parent": starts,
        },
        Evidence.COMMITTED,
    )
    found = issuance._continued_pretraining(claims, lineage)
    if caught is None:
        assert found == []
    else:
        (violation,) = found
        assert violation["limit"] == "regime" and violation["declared"] == "pretraining"
        assert caught in violation["message"] and "certificate 7" in violation["message"]
