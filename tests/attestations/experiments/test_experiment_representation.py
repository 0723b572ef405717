"""Experiment.to_dict (the fast path of list and detail) matches ExperimentSerializer exactly."""

from __future__ import annotations

import json

from rest_framework.renderers import JSONRenderer

from attestations.api.experiments import ExperimentSerializer
from attestations.experiments.models import Experiment
from tests.attestations.base import World


def test_to_dict_matches_the_serializer(world: World) -> None:
    experiments = list(Experiment.objects.with_summary())
    Experiment.summarize(experiments)
    for experiment in experiments:
        fast = json.loads(JSONRenderer().render(experiment.to_dict()))
        slow = json.loads(JSONRenderer().render(ExperimentSerializer(experiment).data))
        assert fast == slow
    plain = Experiment.objects.get(pk=world.experiment.pk)  # not annotated
    assert json.loads(JSONRenderer().render(plain.to_dict())) == json.loads(
        JSONRenderer().render(ExperimentSerializer(plain).data)
    )


def test_a_list_row_is_the_same_document_as_to_dict(world: World) -> None:
    """The list's rows (summary_rows, summary_dict) say what to_dict says, proofs and all."""
    from attestations.experiments.models import proof_statuses, summary_dict
    from attestations.proofs.models import Proof, ProofStatus

    spec = world.experiment.current_spec
    assert spec is not None
    for status in (ProofStatus.VALID, ProofStatus.REJECTED, ProofStatus.REJECTED):
        Proof.objects.create(
            experiment=world.experiment,
            spec=spec,
            transcript=world.proof.transcript,
            status=status,
        )
    experiments = list(Experiment.objects.with_summary().order_by("pk"))
    Experiment.summarize(experiments)
    rows = list(Experiment.objects.order_by("pk").summary_rows())
    statuses = proof_statuses()
    assert len(rows) == len(experiments) > 1
    for experiment, row in zip(experiments, rows, strict=True):
        expected = json.loads(JSONRenderer().render(experiment.to_dict()))
        assert json.loads(JSONRenderer().render(summary_dict(row, statuses))) == expected
    assert any(summary_dict(row, statuses)["proofs"] for row in rows)
    assert any(summary_dict(row, statuses)["spec"]["frozen"] for row in rows)


def test_the_list_pages_through_every_experiment_once(world: World) -> None:
    """Cursor pages of plain rows: every visible experiment once, newest first."""
    from rest_framework.test import APIClient

    from attestations.accounts.models import ApiKey
    from tests.attestations.base import SPEC

    for index in range(5):
        Experiment.register(world.acme, f"paged-{index}", SPEC, user=world.alice)
    _, raw = ApiKey.issue(world.alice, "pages")
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {raw}")
    seen: list[str] = []
    url: str | None = "/api/v1/experiments/?page_size=2"
    while url is not None:
        response = client.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        assert len(body["results"]) <= 2
        seen += [item["id"] for item in body["results"]]
        url = body["next"]
    expected = [
        experiment.full_name
        for experiment in Experiment.objects.filter(owner__in=[world.acme]).order_by(
            "-created", "-id"
        )
    ]
    assert seen == expected and len(seen) >= 6
