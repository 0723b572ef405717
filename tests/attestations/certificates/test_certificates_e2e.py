"""Certificates at the end of the real flow: a Torch run filed, challenged, answered, replayed.

Uses the replay tests' training runs and API helpers (``test_replay.py``): the verdict
queues ``issue_certificate`` on commit, and the certificate must then carry the replay
evidence and verify offline from the bundle the API serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.certificates.models import Certificate
from attestations.proofs.models import ProofStatus
from dvbench.attest import TrustRoot, verify_bundle
from tests.attestations.challenges.test_replay import (
    ORG,
    answer,
    file_and_answer,
    file_transcript,
    platform,
    services,
    train_torch,
    wait_for,
)

__all__ = ["platform", "services"]  # fixtures, used by name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("certificate-runs")
    return {
        "honest": train_torch(base / "honest", "torch-run"),
        "lr": train_torch(base / "lr", "torch-run", forge="lr"),
    }


def _verified(client: APIClient, proof_id: int) -> dict[str, Any]:
    bundle = client.get(f"/api/v1/proofs/{proof_id}/bundle/")
    assert bundle.status_code == 200, bundle.content
    root = TrustRoot.from_json(APIClient().get("/api/v1/trust-root/").content)
    result = verify_bundle(bundle.content, root)
    assert result.ok, result.summary()
    assert result.certificate is not None
    return result.certificate.to_statement().to_dict()


def test_an_honest_run_is_certified_passed_with_its_replay_evidence(
    platform: APIClient, torch_runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    proof, attached = file_and_answer(
        platform, torch_runs["honest"], django_capture_on_commit_callbacks
    )
    assert attached.status_code == 201 and proof.status == ProofStatus.VALID
    certificate = Certificate.objects.get(proof=proof)
    assert certificate.result == "PASSED"
    statement = _verified(platform, proof.pk)
    replay = statement["predicate"]["replay"]
    assert replay["challengeSeed"] == proof.revealed_seed
    challenged = set()
    for step, through in proof.challenges.values_list("step", "through"):
        challenged.update(range(step, (through if through is not None else step) + 1))
    assert replay["challengedSteps"] == sorted(challenged)
    claims = {claim["name"]: claim for claim in statement["predicate"]["claims"]}
    assert claims["optimizer"]["evidence"] == "verified_by_replay"
    # The replay recounted every step's tokens and FLOPs from the torch.export program.
    assert claims["tokens"]["evidence"] == "verified_by_replay"
    assert claims["flops"]["evidence"] == "verified_by_replay"
    assert claims["limit_violations"]["value"] == []
    assert statement["subject"][0]["digest"]["zkdv-transcript"] == proof.transcript_digest


def test_a_run_forged_outside_the_transcript_is_certified_failed(
    platform: APIClient, torch_runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    proof, _ = file_and_answer(platform, torch_runs["lr"], django_capture_on_commit_callbacks)
    assert proof.status == ProofStatus.REJECTED, proof.reason
    assert Certificate.objects.get(proof=proof).result == "FAILED"
    statement = _verified(platform, proof.pk)
    assert statement["predicate"]["result"] == "FAILED"
    assert statement["predicate"]["replay"]["challengeSeed"] == proof.revealed_seed


@pytest.mark.services
def test_the_worker_certifies_an_honest_run(
    services: tuple[APIClient, Any], torch_runs: dict[str, Path]
) -> None:
    client, worker = services
    run, experiment = torch_runs["honest"], f"{ORG}/torch-run"
    filed = file_transcript(client, run, experiment)
    assert filed.status_code == 200, filed.content
    proof_id = filed.json()["proof"]
    proof = wait_for(proof_id, lambda p: p.status == ProofStatus.CHALLENGED, worker)
    assert answer(client, proof_id, run, experiment).status_code == 201
    proof = wait_for(proof_id, lambda p: Certificate.objects.filter(proof=p).exists(), worker)
    assert proof.status == ProofStatus.VALID
    assert _verified(client, proof_id)["predicate"]["result"] == "PASSED"
