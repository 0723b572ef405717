"""Data-content queries: ``POST /api/v1/proofs/<id>/data-queries/``.

The synthetic run draws batch words from [0, 1000), so a window containing 1000 or more
can never occur, and a window cut from one committed batch row occurs in that step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from django.core.cache import cache
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from rest_framework.test import APIClient

from attestations.audit.models import AuditEvent
from attestations.proofs.models import ProofArtifact
from attestations.reports.data_queries import CommittedBatches, search_batches, verified_key
from tests.attestations.base import World, error_of
from tests.attestations.certificates.test_claims import STEPS, filed_proof
from zkdv.batch import commit_batch
from zkdv.files import batch_path, read_batch

Api = Callable[[str | None], APIClient]
WINDOW = 4  # the rolling window filed_proof's run commits


def url(proof_id: int) -> str:
    return f"/api/v1/proofs/{proof_id}/data-queries/"


def window_from(proof_dir: Path, step: int, row: int, col: int) -> list[int]:
    batch = read_batch(batch_path(proof_dir, step))
    return [int(word) for word in batch[row, col : col + WINDOW]]


def test_a_window_from_a_committed_batch_is_found_in_its_step(
    world: World, api: Api, tmp_path: Path
) -> None:
    proof, proof_dir = filed_proof(world, tmp_path)
    window = window_from(proof_dir, 2, 3, 1)
    response = api("bob").post(url(proof.pk), {"window": window}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["found"] is True
    assert body["steps"] == [2]
    assert (body["steps_committed"], body["steps_searched"], body["complete"]) == (
        STEPS,
        STEPS,
        True,
    )
    # Step indices and counts only: no batch words come back.
    assert set(body) == {
        "proof",
        "window_length",
        "found",
        "steps",
        "step_count",
        "steps_truncated",
        "steps_committed",
        "steps_searched",
        "steps_without_batch",
        "batches_not_matching",
        "complete",
    }


def test_a_window_that_never_occurs_is_a_miss(world: World, api: Api, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path)
    response = api("alice").post(url(proof.pk), {"window": [1000, 1, 2, 3]}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["found"], response.json()["steps"]) == (False, [])


@pytest.mark.parametrize("length", [1, 3, 5, 64])
def test_a_window_of_another_length_is_a_precise_400(
    world: World, api: Api, tmp_path: Path, length: int
) -> None:
    proof, _ = filed_proof(world, tmp_path)
    response = api("bob").post(url(proof.pk), {"window": list(range(length))}, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("window_length", "window")
    assert error["detail"] == {"expected": WINDOW, "got": length}
    assert f"expected exactly {WINDOW} tokens" in error["message"]
    assert not AuditEvent.objects.filter(action="proof.data_query").exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [({}, "window"), ({"window": []}, "window"), ({"window": [1, 2, -1, 3]}, "window.2")],
)
def test_malformed_windows_are_400(
    world: World, api: Api, tmp_path: Path, body: dict[str, object], field: str
) -> None:
    proof, _ = filed_proof(world, tmp_path)
    response = api("bob").post(url(proof.pk), body, format="json")
    assert response.status_code == 400
    assert error_of(response)["field"] == field


@pytest.mark.parametrize(
    ("actor", "status"),
    [("alice", 200), ("bob", 200), ("admin", 200), ("carol", 403), ("mallory", 404)],
)
def test_who_may_query(world: World, api: Api, tmp_path: Path, actor: str, status: int) -> None:
    proof, _ = filed_proof(world, tmp_path)
    response = api(actor).post(url(proof.pk), {"window": [1, 2, 3, 4]}, format="json")
    assert response.status_code == status, response.content
    recorded = AuditEvent.objects.filter(action="proof.data_query", actor_name=actor).exists()
    assert recorded is (status == 200)


def test_anonymous_callers_are_refused(world: World, api: Api, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path)
    response = api(None).post(url(proof.pk), {"window": [1, 2, 3, 4]}, format="json")
    assert response.status_code in (401, 403)


def test_each_query_is_an_audit_event_without_the_window(
    world: World, api: Api, tmp_path: Path
) -> None:
    proof, proof_dir = filed_proof(world, tmp_path)
    window = window_from(proof_dir, 4, 0, 0)
    api("bob").post(url(proof.pk), {"window": window}, format="json")
    event = AuditEvent.objects.get(action="proof.data_query")
    assert (event.actor_name, event.target_id) == ("bob", str(proof.pk))
    assert event.detail["found"] is True and event.detail["window_length"] == WINDOW
    digest = hashlib.sha256(np.asarray(window, dtype="<u4").tobytes()).hexdigest()
    assert event.detail["window_sha256"] == digest
    assert "window" not in event.detail


def test_a_batch_file_that_does_not_match_its_commitment_is_never_searched(
    world: World, api: Api, tmp_path: Path
) -> None:
    proof, proof_dir = filed_proof(world, tmp_path)
    window = window_from(proof_dir, 1, 0, 0)
    artifact = ProofArtifact.objects.get(proof=proof, name="files/batch-00000001.u32")
    # The synthetic run is deterministic, so an earlier test may have checked this very
    # file (by digest) already: forget that, as for a file the platform never saw.
    root = commit_batch(read_batch(batch_path(proof_dir, 1)), WINDOW).root
    cache.delete(verified_key(artifact.sha256, root))
    # Replace the stored bytes behind the blob: a tampered store, not a new upload.
    data = batch_path(proof_dir, 3).read_bytes()  # another step's batch, same shape
    default_storage.delete(artifact.blob.storage_name)
    default_storage.save(artifact.blob.storage_name, ContentFile(data))
    body = api("bob").post(url(proof.pk), {"window": window}, format="json").json()
    assert body["batches_not_matching"] == [1]
    assert 1 not in body["steps"]
    assert body["complete"] is False


def test_steps_without_a_stored_batch_are_counted(world: World, api: Api, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path)
    ProofArtifact.objects.filter(proof=proof, name__in=["files/batch-00000000.u32"]).delete()
    body = api("bob").post(url(proof.pk), {"window": [1000, 0, 0, 0]}, format="json").json()
    assert (body["steps_searched"], body["steps_without_batch"], body["complete"]) == (
        STEPS - 1,
        1,
        False,
    )


def test_search_batches_finds_every_step_and_no_other() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, size=(3, 9), dtype=np.uint32) for _ in range(4)]
    needle = [7, 7, 7]
    batches[0][1, 2:5] = needle
    batches[3][2, 6:9] = needle
    for k in (1, 2):  # make sure no accidental hit
        batches[k][batches[k] == 7] = 8
    commitments = [commit_batch(batch, 3) for batch in batches]
    committed = CommittedBatches(3, {k: (c.root, c.windows) for k, c in enumerate(commitments)})
    result = search_batches(needle, committed, enumerate(batches))
    assert result.steps == [0, 3]
    assert result.complete


def test_a_proof_whose_transcript_cannot_be_read_answers_409(world: World, api: Api) -> None:
    # world.proof's blob is not a transcript at all.
    response = api("bob").post(url(world.proof.pk), {"window": [1, 2, 3, 4]}, format="json")
    assert response.status_code == 409
    assert error_of(response)["code"] == "no_rolling_window"
