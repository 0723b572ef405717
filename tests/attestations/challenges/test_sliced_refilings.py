"""A revealed seed gives a later filing of the same run file nothing (issue 59, item 5).

The security round filed one run file, let the filing settle, read its revealed seed,
filed the same bytes again and, trying answers a few ulps apart offline, predicted
exactly which sequences the re-filing would open. Now a later filing faces the first
filing's slices, must give each slice's first answer byte for byte (so it draws the
same sequences), and the seed is shown only once every slice of the run file has an
answer.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from django.utils import timezone

from attestations.challenges import sliced_verdicts
from attestations.challenges.models import SlicedChallenge, SlicedRun, SliceStatus
from tests.attestations.base import World, error_of, upload_blob
from tests.attestations.challenges.test_sliced_runs import (  # noqa: F401 - _small_policy
    LMInput,
    _small_policy,
    drawn,
    file_run,
    put_answer,
    settled,
    train,
)
from zkdv import sliced

HEIST = "/api/v1/experiments/evil/heist/sliced-runs/"


def file_again(client: Any, lab: sliced.TorchLab, path: str = HEIST) -> dict[str, Any]:
    """Another lab uploads the same programs and run file (its own blobs) and files it."""
    blocks, embed, archives = lab.programs(LMInput(lab.model))
    data = lab.run_file(blocks, embed).to_bytes()
    for blob in [*archives.values(), data]:
        response = upload_blob(client, blob, experiment="evil/heist", part_size=64 * 1024)
        assert response.status_code in (200, 201), response.content
    response = client.post(path, {"run_file": hashlib.sha256(data).hexdigest()}, format="json")
    assert response.status_code == 201, response.content
    return response.json()  # type: ignore[no-any-return]


def answer_bytes(lab: sliced.TorchLab, challenge: dict[str, Any]) -> bytes:
    return sliced.answer_to_bytes(lab.answer(drawn(challenge)).projections)


def expire(run: dict[str, Any]) -> None:
    past = timezone.now() - timezone.timedelta(days=1)
    SlicedRun.objects.filter(pk=run["id"]).update(deadline=past)
    sliced_verdicts.expire()


def test_a_refiling_faces_the_first_filings_slices_and_answers(
    world: World, api: Any, settings: Any
) -> None:
    lab = train(8)
    alice, mallory = api("alice"), api("mallory")
    first = file_run(alice, lab)
    # Slice 0 answered, slice 1 left to expire: the first filing fails.
    answered = put_answer(alice, first, 0, answer_bytes(lab, first["challenges"][0]))
    assert answered.status_code == 200
    expire(first)
    done = settled(alice, first)
    assert done["status"] == "failed"
    # Slice 1 was never answered anywhere: its seed would let a re-filing try answers
    # offline until the draw suits it. It stays hidden, the run settled or not.
    assert done["seed"] is None

    # The policy changed since; the re-filing still faces the first filing's slices.
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_CHALLENGES": 5, "SLICED_OPENED": 3}
    again = file_again(mallory, lab)
    keys = ("index", "step", "block", "directions", "projections", "opened")
    assert [{k: c[k] for k in keys} for c in again["challenges"]] == [
        {k: c[k] for k in keys} for c in first["challenges"]
    ]
    assert again["seed_commitment"] == first["seed_commitment"] and again["seed"] is None

    # Slice 0 must be answered as it was, byte for byte: one ulp off is refused...
    good = answer_bytes(lab, again["challenges"][0])
    projections = np.frombuffer(good, dtype="<f8").copy()
    projections[3] = np.nextafter(projections[3], np.inf)
    nudged = put_answer(mallory, again, 0, projections.astype("<f8").tobytes())
    assert nudged.status_code == 409, nudged.content
    error = error_of(nudged)
    assert (error["code"], error["field"], error["detail"]) == (
        "answer_differs",
        "body",
        {"index": 0},
    )
    assert "byte for byte" in error["message"]
    stored = SlicedChallenge.objects.get(run_id=again["id"], index=0)
    assert stored.status == SliceStatus.AWAITING_ANSWER and stored.answer is None
    # ...and the same bytes draw the same sequences.
    same = put_answer(mallory, again, 0, good)
    assert same.status_code == 200
    assert same.json()["sequences"] == answered.json()["sequences"]

    # Slice 1 had no answer: the re-filing's first answer pins it.
    assert (
        put_answer(mallory, again, 1, answer_bytes(lab, again["challenges"][1])).status_code == 200
    )
    # Every slice of the run file is now answered: the settled first filing's seed helps
    # nobody and is shown; the open re-filing's is not until it settles.
    revealed = settled(alice, first)["seed"]
    assert revealed is not None
    assert settled(mallory, again)["seed"] is None
    # The list says the same, the answers read once for the page.
    listed = alice.get("/api/v1/experiments/acme/run-1/sliced-runs/").json()["results"]
    assert [run["seed"] for run in listed] == [revealed]
    assert [run["seed"] for run in mallory.get(HEIST).json()["results"]] == [None]


def test_an_answer_pinned_by_a_later_filing_binds_the_first(world: World, api: Any) -> None:
    lab = train(9)
    alice, mallory = api("alice"), api("mallory")
    first = file_run(alice, lab)
    again = file_again(mallory, lab)
    good = answer_bytes(lab, again["challenges"][1])
    assert put_answer(mallory, again, 1, good).status_code == 200
    # The first filing answers slice 1 after the re-filing did: the same bytes or a 409.
    other = np.frombuffer(good, dtype="<f8") * (1 + 1e-15)
    response = put_answer(alice, first, 1, other.astype("<f8").tobytes())
    assert response.status_code == 409 and error_of(response)["code"] == "answer_differs"
    assert put_answer(alice, first, 1, good).status_code == 200
