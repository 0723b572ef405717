"""List endpoints cost a fixed number of queries, however many rows a page holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.experiments.models import Experiment
from attestations.proofs.models import Job, Proof
from tests.attestations.base import SPEC, World

Api = Callable[[str | None], APIClient]


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/experiments/",
        "/api/v1/proofs/",
        "/api/v1/jobs/",
        "/api/v1/uploads/",
        "/api/v1/audit-events/",
    ],
)
def test_lists_do_not_query_per_row(
    url: str, world: World, api: Api, django_assert_max_num_queries: Any
) -> None:
    for index in range(20):
        experiment = Experiment.register(world.acme, f"many-{index}", SPEC, user=world.alice)
        assert experiment.current_spec is not None
        proof = Proof.objects.create(
            experiment=experiment, spec=experiment.current_spec, transcript=world.proof.transcript
        )
        Job.objects.create(kind="ingest", organization=world.acme, proof=proof)
    client = api("alice")
    client.get("/api/v1/me/")  # the key's last_used write happens once, not in the count
    with django_assert_max_num_queries(5):
        response = client.get(url)
    assert response.status_code == 200
