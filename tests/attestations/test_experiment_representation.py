"""Experiment.to_dict (the fast path of list and detail) matches ExperimentSerializer exactly."""

from __future__ import annotations

import json

from rest_framework.renderers import JSONRenderer

from attestations.api.serializers import ExperimentSerializer
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
