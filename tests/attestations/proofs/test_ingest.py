"""Ingest: completing a transcript upload files a proof that the offline verifier judges."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from attestations.audit.models import AuditEvent
from attestations.certificates.models import Certificate
from attestations.proofs import models as attestation_models
from attestations.proofs.models import Job, Proof, ProofArtifact, ProofStatus
from attestations.proofs.tasks import ingest_proof
from attestations.uploads.models import Blob, Upload, UploadPart
from tests.attestations.base import SPEC, World, error_of, sha256, stored_files, upload_blob
from tests.synthetic import write_synthetic_transcript

Api = Callable[[str | None], APIClient]

# Synthetic transcripts (tests/synthetic.py) commit no program; the platform rejects those by
# default (``no_program``), so these tests opt out, except where they say otherwise.
pytestmark = pytest.mark.usefixtures("programless_transcripts")


def proof_dir(
    tmp_path: Path,
    experiment: str,
    spec_digest: str,
    *,
    steps: int = 4,
    prover: str = "whitebox-jax",
) -> Path:
    return Path(
        write_synthetic_transcript(
            tmp_path / f"proof-{experiment.replace('/', '-')}-{spec_digest[:6]}-{steps}-{prover}",
            steps=steps,
            experiment=experiment,
            spec_digest=spec_digest,
            seed=0,
            prover=prover,
        )
    )


def transcript(
    tmp_path: Path,
    experiment: str,
    spec_digest: str,
    *,
    steps: int = 4,
    prover: str = "whitebox-jax",
) -> bytes:
    folder = proof_dir(tmp_path, experiment, spec_digest, steps=steps, prover=prover)
    return (folder / "records.cborl").read_bytes()


def attach_probes(proof_id: int, data: bytes) -> None:
    """Attach ``data`` as the proof's ``probes.bin``, as the SDK's artifact list does."""
    digest = sha256(data)
    name = default_storage.save(Blob.address(digest), ContentFile(data))
    blob = Blob.objects.create(sha256=digest, size=len(data), storage_name=name)
    ProofArtifact.objects.create(
        proof_id=proof_id,
        name="probes.bin",
        kind="artifact",
        blob=blob,
        sha256=digest,
        size=len(data),
    )


def digest_of(world: World) -> str:
    assert world.experiment.current_spec is not None
    return world.experiment.current_spec.digest


def test_a_valid_transcript_is_verified(
    world: World, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    data = transcript(tmp_path, "acme/run-1", digest_of(world))
    with django_capture_on_commit_callbacks(execute=True):
        response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)
    assert response.status_code == 200, response.content
    proof = Proof.objects.get(pk=response.json()["proof"])
    assert proof.status == ProofStatus.VALID, (proof.reason, proof.message)
    assert (proof.steps, proof.prover) == (4, "whitebox-jax")
    assert proof.transcript_digest
    job = Job.objects.get(proof=proof)
    assert (job.status, job.progress) == ("succeeded", 1.0)
    assert AuditEvent.objects.filter(action="proof.valid", target_id=str(proof.pk)).exists()
    body = api("bob").get(f"/api/v1/proofs/{proof.pk}/").json()
    assert body["status"] == "valid"
    assert body["job"]["status"] == "succeeded"


def test_a_tampered_transcript_is_rejected_with_its_reason(
    world: World, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    data = bytearray(transcript(tmp_path, "acme/run-1", digest_of(world)))
    # Flip one byte well after the root record: the chain breaks at a later record.
    data[len(data) // 2] ^= 0x01
    with django_capture_on_commit_callbacks(execute=True):
        response = upload_blob(api("alice"), bytes(data), kind="transcript", part_size=4096)
    assert response.status_code == 200
    proof = Proof.objects.get(pk=response.json()["proof"])
    assert proof.status == ProofStatus.REJECTED
    assert proof.reason and proof.message
    assert proof.record_index is not None and proof.record_index > 0
    assert AuditEvent.objects.filter(action="proof.rejected").exists()


def test_a_transcript_of_another_experiment_is_refused(
    world: World, api: Api, tmp_path: Path, storage: Path
) -> None:
    data = transcript(tmp_path, "evil/heist", digest_of(world))
    before = (stored_files(storage), Blob.objects.count(), Proof.objects.count())
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "experiment_mismatch"
    assert error["field"] == "root.experiment.name"
    assert "'evil/heist'" in error["message"] and "'acme/run-1'" in error["message"]
    assert (stored_files(storage), Blob.objects.count(), Proof.objects.count()) == before
    assert UploadPart.objects.count() == 0
    assert Upload.objects.filter(reason="experiment_mismatch", status="failed").count() == 1


def test_a_transcript_of_another_spec_is_refused(
    world: World, api: Api, tmp_path: Path, storage: Path
) -> None:
    data = transcript(tmp_path, "acme/run-1", "cd" * 32)
    before = (stored_files(storage), Blob.objects.count(), Proof.objects.count())
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)
    assert response.status_code == 422
    error = error_of(response)
    assert (error["code"], error["field"]) == ("spec_mismatch", "root.experiment.spec_digest")
    assert (stored_files(storage), Blob.objects.count(), Proof.objects.count()) == before


def test_a_transcript_of_another_framework_is_refused(
    world: World, api: Api, tmp_path: Path, storage: Path
) -> None:
    data = transcript(tmp_path, "acme/run-1", digest_of(world), prover="whitebox-torch")
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)
    assert response.status_code == 422
    error = error_of(response)
    assert (error["code"], error["field"]) == ("framework_mismatch", "root.prover")
    assert "'whitebox-jax'" in error["message"]
    assert Proof.objects.count() == 1  # the world's


def test_the_spec_freezes_once_a_proof_names_it(
    world: World, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    first = digest_of(world)
    with django_capture_on_commit_callbacks(execute=True):
        upload_blob(
            api("alice"),
            transcript(tmp_path, "acme/run-1", first),
            kind="transcript",
            part_size=4096,
        )
    response = api("alice").post(
        "/api/v1/experiments/acme/run-1/specs/", {**SPEC, "max_tokens": 5}, format="json"
    )
    assert response.status_code == 201
    assert response.json()["version"] == 2
    assert response.json()["digest"] != first
    # A transcript made against version 1 is still filed under version 1.
    with django_capture_on_commit_callbacks(execute=True):
        late = upload_blob(
            api("alice"),
            transcript(tmp_path, "acme/run-1", first, steps=3),
            kind="transcript",
            part_size=4096,
        )
    proof = Proof.objects.get(pk=late.json()["proof"])
    assert proof.status == ProofStatus.VALID
    assert proof.spec.version == 1


def test_ingest_is_idempotent(world: World, api: Api, tmp_path: Path) -> None:
    data = transcript(tmp_path, "acme/run-1", digest_of(world))
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)  # not yet run
    proof_id = response.json()["proof"]
    assert Proof.objects.get(pk=proof_id).status == ProofStatus.PENDING
    assert ingest_proof(proof_id) == ProofStatus.VALID
    assert ingest_proof(proof_id) is None  # a redelivered message finds nothing to do
    assert AuditEvent.objects.filter(action="proof.valid", target_id=str(proof_id)).count() == 1


def test_a_database_lost_mid_verdict_keeps_nothing_and_the_retry_completes(
    world: World, api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict, its audit event and the job's end commit together or not at all.

    Seen in CI: PostgreSQL restarted between the verdict and the job's end left a valid
    proof whose ingest job stayed ``running`` for ever (the retry found the proof final
    and had nothing to do). The connection is cut here at the job's end, the last write.
    """
    from django.db import OperationalError

    data = transcript(tmp_path, "acme/run-1", digest_of(world))
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)  # not yet run
    proof_id = response.json()["proof"]
    finish = Job.finish

    def connection_lost(job: Job, status: str, reason: str = "") -> None:
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(Job, "finish", connection_lost)
    with pytest.raises(OperationalError):
        ingest_proof(proof_id)  # called directly, the task's retry re-raises
    proof = Proof.objects.get(pk=proof_id)
    assert proof.status == ProofStatus.PENDING  # handed back for the retry
    assert not AuditEvent.objects.filter(target_type="proof", target_id=str(proof_id)).filter(
        action__in=["proof.valid", "proof.rejected", "proof.error"]
    )
    assert Job.objects.get(proof_id=proof_id).status != "succeeded"
    monkeypatch.setattr(Job, "finish", finish)
    assert ingest_proof(proof_id) == ProofStatus.VALID
    assert Job.objects.get(proof_id=proof_id).status == "succeeded"
    assert AuditEvent.objects.filter(action="proof.valid", target_id=str(proof_id)).count() == 1


@pytest.mark.services
def test_ingest_through_a_real_worker(
    transactional_db: None, celery_worker_process: Any, tmp_path: Path, settings: Any
) -> None:
    """The whole path over Redis to a separate worker process, against PostgreSQL."""
    import time

    from django.contrib.auth.models import User

    from attestations.accounts.models import Membership, Organization
    from attestations.experiments.models import Experiment
    from attestations.uploads import services as uploads
    from attestations.uploads.parts import put_part

    org = Organization.objects.create(slug="acme", name="Acme")
    alice = User.objects.create_user("alice", password="x" * 20)
    Membership.objects.create(user=alice, organization=org, role="trainer")
    experiment = Experiment.register(org, "worker-run", SPEC, user=alice)
    assert experiment.current_spec is not None
    data = transcript(tmp_path, "acme/worker-run", experiment.current_spec.digest)
    upload = uploads.create(
        experiment=experiment,
        kind="transcript",
        size=len(data),
        sha256=__import__("hashlib").sha256(data).hexdigest(),
        user=alice,
    )
    from io import BytesIO

    put_part(
        upload, 1, stream=BytesIO(data), declared_sha256=upload.sha256, content_length=len(data)
    )
    uploads.complete(upload, user=alice)
    proof = Proof.objects.get(upload=upload)
    deadline = time.monotonic() + 120  # generous: CI machines are shared
    while time.monotonic() < deadline:
        proof.refresh_from_db()
        if proof.is_final:
            break
        time.sleep(0.2)
    # The worker runs with the platform's defaults (its own environment, not this
    # process's settings): a transcript without a program is rejected, not trusted.
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "no_program"), (
        proof.status,
        proof.reason,
        celery_worker_process.log()[-2000:],
    )
    assert (proof.record_index, proof.field) == (0, "root.program")
    job = Job.objects.get(proof=proof)
    assert job.task_id and job.status == "succeeded"
    # The worker then certifies the verdict (waiting for it also lets the worker go
    # quiet before the database is flushed).
    while time.monotonic() < deadline and not Certificate.objects.filter(proof=proof).exists():
        time.sleep(0.2)
    assert Certificate.objects.get(proof=proof).result == "FAILED", celery_worker_process.log()[
        -2000:
    ]
    _ = os


def test_a_transcript_without_a_program_is_rejected_by_default(
    world: World, api: Api, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """Leaving the program out must not dodge the challenges: no program, no verdict valid."""
    settings.DVBENCH = {**settings.DVBENCH, "REQUIRE_PROGRAM": True}
    data = transcript(tmp_path, "acme/run-1", digest_of(world))
    with django_capture_on_commit_callbacks(execute=True):
        response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)
    proof = Proof.objects.get(pk=response.json()["proof"])
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "no_program")
    assert (proof.record_index, proof.field) == (0, "root.program")
    assert "commits no program artifact" in proof.message
    assert not proof.challenges.exists()
    assert AuditEvent.objects.filter(action="proof.rejected", target_id=str(proof.pk)).exists()
    body = api("bob").get(f"/api/v1/proofs/{proof.pk}/").json()
    assert (body["status"], body["reason"]) == ("rejected", "no_program")
    certificate = Certificate.objects.get(proof=proof)  # issued once the verdict is final
    assert certificate.result == "FAILED"


def test_a_missing_transcript_is_an_error_verdict_not_a_stuck_proof(
    world: World, storage: Path
) -> None:
    (storage / world.proof.transcript.storage_name).unlink()
    Proof.objects.filter(pk=world.proof.pk).update(status=ProofStatus.PENDING)
    assert ingest_proof(world.proof.pk) == ProofStatus.ERROR
    world.proof.refresh_from_db()
    assert world.proof.reason == "verifier_failed"
    assert "FileNotFoundError" in world.proof.message
    assert Job.objects.get(pk=world.job.pk).status == "failed"


@pytest.mark.parametrize("tamper", [False, True])
def test_an_attached_probe_file_is_checked_against_the_probe_digests(
    world: World, api: Api, tmp_path: Path, tamper: bool
) -> None:
    """Ingest verifies ``probes.bin`` when the proof has it; a flipped byte is named."""
    folder = proof_dir(tmp_path, "acme/run-1", digest_of(world))
    data = (folder / "records.cborl").read_bytes()
    probes = bytearray((folder / "probes.bin").read_bytes())
    if tamper:
        probes[5] ^= 0x40  # inside the first step's probe range
    response = upload_blob(api("alice"), data, kind="transcript", part_size=4096)  # not yet run
    proof_id = response.json()["proof"]
    attach_probes(proof_id, bytes(probes))
    ingest_proof(proof_id)
    proof = Proof.objects.get(pk=proof_id)
    if not tamper:
        assert proof.status == ProofStatus.VALID, (proof.reason, proof.message)
        return
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "probe_digest")
    assert proof.field == "probe.digest"
    assert proof.message == "step 0 probe bytes do not match their committed digest"
    assert proof.record_index is not None and proof.record_index > 0


def test_ingest_reports_progress_that_rises_to_one(
    world: World, api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long transcript moves its job forward while verifying, never backwards."""
    monkeypatch.setattr(attestation_models, "INGEST_PROGRESS_INTERVAL", 0.0)  # every report
    data = transcript(tmp_path, "acme/run-1", digest_of(world), steps=600)
    response = upload_blob(api("alice"), data, kind="transcript", part_size=65536)
    proof_id = response.json()["proof"]
    with CaptureQueriesContext(connection) as queries:
        assert ingest_proof(proof_id) == ProofStatus.VALID
    written = [
        float(match.group(1))
        for query in queries.captured_queries
        if (
            match := re.search(
                r'UPDATE "attestations_job" SET "progress" = ([0-9.e-]+)', query["sql"]
            )
        )
    ]
    assert len(written) >= 3, written
    assert written == sorted(written) and len(set(written)) == len(written), written
    assert written[0] > 0.0 and written[-1] < 1.0
    job = Job.objects.get(proof_id=proof_id)
    assert (job.status, job.progress) == ("succeeded", 1.0)
