"""The spec digest: SHA-256 of the canonical JSON document, versioned once frozen."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from rest_framework.test import APIClient

from attestations.experiments.models import Experiment, ExperimentSpec
from tests.attestations.base import SPEC, World, error_of

Api = Callable[[str | None], APIClient]


def test_the_digest_is_documented_canonical_json(world: World) -> None:
    spec = world.experiment.current_spec
    assert spec is not None
    document = {
        "schema": "dvbench.spec/v1",
        "experiment": "acme/run-1",
        "framework": "jax",
        "model": SPEC["model_description"],
        "optimizer": SPEC["optimizer"],
        "dataset_commitment": "ab" * 32,
        "limits": {
            "max_flops": 10**25,
            "max_tokens": 2 * 10**12,
            "max_gpu_hours": "1200.5",
            "allowed_regimes": ["pretraining"],
        },
    }
    encoded = json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    assert spec.digest == hashlib.sha256(encoded).hexdigest()
    assert b"10000000000000000000000000" in encoded  # FLOPs exact, not 1e+25


def test_a_spec_counting_tokens_says_so_in_its_digest(world: World, api: Api) -> None:
    # A spec declared before token_unit existed keeps its digest (the unit enters the
    # document only when it is "tokens"); one that counts tokens has another digest,
    # which the SDK computes the same way offline.
    import dvbench

    before = world.experiment.current_spec
    assert before is not None and before.token_unit == "examples"
    assert before.digest == dvbench.spec_digest("acme/run-1", {**SPEC, "token_unit": "examples"})
    response = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "token_unit": "tokens"}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["token_unit"] == "tokens"
    counted = ExperimentSpec.objects.get(experiment=world.experiment, version=2)
    assert counted.canonical_document()["limits"]["token_unit"] == "tokens"
    assert counted.digest == dvbench.spec_digest("acme/run-1", {**SPEC, "token_unit": "tokens"})
    assert counted.digest != before.digest
    refused = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "token_unit": "words"}, format="json"
    )
    assert refused.status_code == 400 and error_of(refused)["field"] == "token_unit"


def test_the_same_spec_under_two_names_has_two_digests(world: World) -> None:
    assert world.experiment.current_spec is not None and world.other.current_spec is not None
    assert world.experiment.current_spec.digest != world.other.current_spec.digest


def test_an_unfrozen_spec_is_edited_in_place(world: World, api: Api) -> None:
    world.proof.delete()
    response = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "optimizer": "sgd"}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["version"] == 1
    assert ExperimentSpec.objects.filter(experiment=world.experiment).count() == 1


def test_a_frozen_spec_changes_by_new_version(world: World, api: Api) -> None:
    old = world.experiment.current_spec
    assert old is not None and old.is_frozen
    response = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "optimizer": "sgd"}, format="json"
    )
    assert response.status_code == 201
    assert response.json()["version"] == 2
    old.refresh_from_db()
    assert old.optimizer == SPEC["optimizer"]
    detail = api("bob").get("/api/v1/experiments/acme/run-1/").json()
    assert detail["spec"]["version"] == 2
    assert detail["spec_digest"] == response.json()["digest"]
    versions = [
        s["version"] for s in api("bob").get("/api/v1/experiments/acme/run-1/specs/").json()
    ]
    assert versions == [2, 1]


def test_an_identical_spec_changes_nothing(world: World, api: Api) -> None:
    response = api("alice").post("/api/v1/experiments/acme/run-1/specs/", SPEC, format="json")
    assert response.status_code == 200
    assert response.json()["version"] == 1


def test_registration_validates_the_spec(world: World, api: Api) -> None:
    bad = {**SPEC, "framework": "tensorflow", "dataset_commitment": "xyz", "max_flops": 1e25}
    response = api("alice").post(
        "/api/v1/experiments/", {"name": "acme/run-9", "spec": bad}, format="json"
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["field"] == "spec.framework"
    assert set(error["detail"]["spec"]) == {"framework", "dataset_commitment", "max_flops"}


def test_registration_accepts_owner_slash_name(world: World, api: Api) -> None:
    response = api("alice").post(
        "/api/v1/experiments/", {"name": "acme/run-9", "spec": SPEC}, format="json"
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["id"] == "acme/run-9"
    assert len(body["spec_digest"]) == 64


def test_a_duplicate_name_is_refused(world: World, api: Api) -> None:
    response = api("alice").post(
        "/api/v1/experiments/", {"name": "acme/run-1", "spec": SPEC}, format="json"
    )
    assert response.status_code == 409
    assert error_of(response)["code"] == "exists"
    assert error_of(response)["field"] == "name"


def test_an_outsider_learns_nothing_about_names(world: World, api: Api) -> None:
    response = api("mallory").post(
        "/api/v1/experiments/", {"name": "acme/run-1", "spec": SPEC}, format="json"
    )
    assert response.status_code == 404


def test_a_registration_race_is_a_409(world: World, api: Api, monkeypatch: Any) -> None:
    original = Experiment.register.__func__  # type: ignore[attr-defined]

    def racing(
        cls: type[Experiment], owner: Any, name: str, spec: Any, **kwargs: Any
    ) -> Experiment:
        # Another request registers the same name after validation, before our insert.
        Experiment.objects.create(owner=owner, name=name)
        return original(cls, owner, name, spec, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Experiment, "register", classmethod(racing))
    response = api("alice").post(
        "/api/v1/experiments/", {"name": "acme/run-9", "spec": SPEC}, format="json"
    )
    assert response.status_code == 409
    assert (error_of(response)["code"], error_of(response)["field"]) == ("exists", "name")
