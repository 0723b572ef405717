"""The Django admin shows challenges and proof artifacts to operators, read-only."""

from __future__ import annotations

import pytest
from django.test import Client

from attestations.challenges.models import Challenge
from attestations.proofs.models import ProofArtifact
from tests.attestations.base import World, make_user


@pytest.fixture
def operator(world: World) -> Client:
    client = Client()
    client.force_login(make_user("root", superuser=True))
    return client


@pytest.fixture
def records(world: World) -> tuple[Challenge, ProofArtifact]:
    challenge = Challenge.objects.create(
        proof=world.proof, step=3, origin="sampled", reason="replay_mismatch"
    )
    blob = world.proof.transcript
    artifact = ProofArtifact.objects.create(
        proof=world.proof,
        name="probes.bin",
        kind="artifact",
        blob=blob,
        sha256=blob.sha256,
        size=blob.size,
    )
    return challenge, artifact


@pytest.mark.parametrize("model", ["challenges/challenge", "proofs/proofartifact"])
def test_operators_see_the_records_but_cannot_change_them(
    operator: Client, records: tuple[Challenge, ProofArtifact], model: str
) -> None:
    row = records[0] if model == "challenges/challenge" else records[1]
    base = f"/admin/{model}/"
    listing = operator.get(base)
    assert listing.status_code == 200
    assert (
        b"replay_mismatch" if model == "challenges/challenge" else b"probes.bin"
    ) in listing.content
    detail = operator.get(f"{base}{row.pk}/change/")
    assert detail.status_code == 200
    assert b'name="_save"' not in detail.content  # a view, not a form
    assert operator.get(f"{base}add/").status_code == 403
    assert operator.post(f"{base}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert operator.post(f"{base}{row.pk}/change/", {"reason": "edited"}).status_code == 403
    assert type(row).objects.filter(pk=row.pk).exists()


def test_members_who_are_not_staff_are_sent_to_the_admin_login(world: World) -> None:
    client = Client()
    client.force_login(world.alice)
    response = client.get("/admin/challenges/challenge/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
