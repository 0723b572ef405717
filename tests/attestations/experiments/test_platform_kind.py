"""A lab declares the platform kind it trains on; a transcript from another is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework.test import APIClient

from attestations.experiments.models import ExperimentSpec
from tests.attestations.base import SPEC, World, error_of

Api = Callable[[str | None], APIClient]


def _root(spec: ExperimentSpec, **env: Any) -> dict[str, Any]:
    return {
        "prover": f"whitebox-{spec.framework}",
        "experiment": {"name": "acme/run-1", "spec_digest": spec.digest},
        "env": env,
    }


def test_a_declared_platform_kind_enters_the_digest_and_the_representation(
    world: World, api: Api
) -> None:
    import dvbench

    before = world.experiment.current_spec
    assert before is not None and before.platform_kind == ""
    # Undeclared: the digest of a spec from before the field existed does not change.
    assert before.digest == dvbench.spec_digest("acme/run-1", SPEC)
    assert before.to_dict()["platform_kind"] is None
    response = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "platform_kind": "tpu"}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["platform_kind"] == "tpu"
    declared = ExperimentSpec.objects.get(experiment=world.experiment, version=2)
    assert declared.canonical_document()["platform_kind"] == "tpu"
    assert declared.digest == dvbench.spec_digest("acme/run-1", {**SPEC, "platform_kind": "tpu"})
    assert declared.digest != before.digest
    assert declared.to_dict(frozen=False)["platform_kind"] == "tpu"


def test_an_unknown_platform_kind_is_refused(world: World, api: Api) -> None:
    refused = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/",
        {**SPEC, "platform_kind": "quantum"},
        format="json",
    )
    assert refused.status_code == 400 and error_of(refused)["field"] == "platform_kind"
    assert ExperimentSpec.objects.filter(experiment=world.experiment).count() == 1


def test_the_root_must_name_the_declared_platform_kind(world: World) -> None:
    spec = ExperimentSpec.create_version(world.experiment, 2, {**SPEC, "platform_kind": "tpu"})
    assert world.experiment.check_identity(_root(spec, platform_kind="tpu")) is None
    # A root from before the kind was recorded: read from the backend it names.
    assert world.experiment.check_identity(_root(spec, jax_platform="tpu")) is None
    assert world.experiment.check_identity(_root(spec, platform_kind="cpu")) == (
        "platform_mismatch",
        "the transcript's root names platform kind 'cpu'; spec version 2 declares the run "
        "trains on 'tpu'",
        "root.env.platform_kind",
    )
    # Undeclared: any kind is accepted (and routed by what the root says).
    undeclared = world.experiment.specs.get(version=1)
    assert world.experiment.check_identity(_root(undeclared, platform_kind="gpu")) is None
