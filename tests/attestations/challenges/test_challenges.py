"""The challenge and artifact API: roles, bad input, idempotency (tasks run in-process).

A real Torch run (from ``test_replay``) is filed; its challenges are listed and
answered through ``/api/v1/proofs/{id}/challenges/`` and ``/artifacts/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey, Membership, Organization, OrganizationKind, Role
from attestations.audit.models import AuditEvent
from attestations.challenges.models import Challenge, ChallengeStatus
from attestations.proofs.models import Proof, ProofArtifact, ProofStatus
from tests.attestations.base import error_of, sha256
from tests.attestations.challenges.test_replay import (
    ORG,
    client_for,
    file_transcript,
    kind_of,
    platform,
    runs,
    upload,
)

__all__ = ["platform", "runs"]

EXPERIMENT = f"{ORG}/torch-run"


def _member(username: str, org: Organization, role: str) -> APIClient:
    user = User.objects.create_user(username, f"{username}@example.org", "x" * 20)
    Membership.objects.create(user=user, organization=org, role=role)
    return client_for(ApiKey.issue(user, "tests")[1])


@pytest.fixture
def filed(
    platform: APIClient, runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> tuple[APIClient, Proof, Path]:
    with django_capture_on_commit_callbacks(execute=True):
        response = file_transcript(platform, runs["honest"], EXPERIMENT)
    proof = Proof.objects.get(pk=response.json()["proof"])
    assert proof.status == ProofStatus.CHALLENGED
    return platform, proof, runs["honest"]


def _send(client: APIClient, run: Path, names: list[str]) -> list[dict[str, Any]]:
    files = []
    for name in names:
        data = (run / name).read_bytes()
        assert upload(client, EXPERIMENT, kind_of(name), data, name).status_code == 200
        files.append(
            {"name": name, "kind": kind_of(name), "sha256": sha256(data), "size": len(data)}
        )
    return files


def test_challenges_list_filters_by_status_and_names_what_they_need(
    filed: tuple[APIClient, Proof, Path], django_capture_on_commit_callbacks: Any
) -> None:
    client, proof, run = filed
    body = client.get(f"/api/v1/proofs/{proof.pk}/challenges/").json()
    assert [c["step"] for c in body["results"]] == list(range(8))
    assert all(c["status"] == "pending" for c in body["results"])
    genesis = Challenge.objects.get(proof=proof, step=0)
    with django_capture_on_commit_callbacks(execute=True):
        attached = client.post(
            f"/api/v1/proofs/{proof.pk}/artifacts/",
            {"files": _send(client, run, genesis.needed_files)},
            format="json",
        )
    assert attached.status_code == 201, attached.content
    assert attached.json()["attached"] == len(genesis.needed_files)
    passed = client.get(f"/api/v1/proofs/{proof.pk}/challenges/?status=passed").json()
    assert [c["step"] for c in passed["results"]] == [0]
    pending = client.get(f"/api/v1/proofs/{proof.pk}/challenges/?status=pending").json()
    assert [c["step"] for c in pending["results"]] == list(range(1, 8))
    bad = client.get(f"/api/v1/proofs/{proof.pk}/challenges/?status=done")
    assert bad.status_code == 400 and error_of(bad)["field"] == "status"
    # Attaching the same files again changes nothing.
    again = client.post(
        f"/api/v1/proofs/{proof.pk}/artifacts/",
        {"files": _send(client, run, genesis.needed_files)},
        format="json",
    )
    assert again.status_code == 200 and again.json()["attached"] == 0
    assert (
        AuditEvent.objects.filter(
            action="proof.artifacts_attached", target_id=str(proof.pk)
        ).count()
        == 1
    )
    # The uploads list finds a blob by digest and keeps the file's name.
    data = (run / "probes.bin").read_bytes()
    found = client.get(f"/api/v1/uploads/?sha256={sha256(data)}").json()["results"]
    assert {(u["name"], u["kind"], u["sha256"]) for u in found} == {
        ("probes.bin", "artifact", sha256(data))
    }


@pytest.mark.parametrize(
    ("name", "kind", "code"),
    [
        ("../etc/passwd", "artifact", "invalid_name"),
        ("/files/batch-00000000.u32", "batch", "invalid_name"),
        ("files/../batch-00000000.u32", "batch", "invalid_name"),
        ("files/sub/batch-00000000.u32", "batch", "invalid_name"),
        ("files/batch-00000000.u32", "snapshot", "invalid_name"),
        ("records.cborl", "transcript", "invalid_kind"),
    ],
)
def test_bad_names_are_refused_and_nothing_is_stored(
    filed: tuple[APIClient, Proof, Path], name: str, kind: str, code: str
) -> None:
    client, proof, run = filed
    good = _send(client, run, ["files/batch-00000000.u32"])
    files = [*good, {**good[0], "name": name, "kind": kind}]
    response = client.post(f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": files}, format="json")
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert (error["code"], error["field"]) == (
        code,
        "files[1].name" if code == "invalid_name" else "files[1].kind",
    )
    assert not ProofArtifact.objects.exists()


def test_a_blob_never_uploaded_by_the_organisation_is_refused(
    filed: tuple[APIClient, Proof, Path],
) -> None:
    client, proof, run = filed
    data = (run / "files/batch-00000001.u32").read_bytes()  # never uploaded
    files = [
        {
            "name": "files/batch-00000001.u32",
            "kind": "batch",
            "sha256": sha256(data),
            "size": len(data),
        }
    ]
    response = client.post(f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": files}, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("blob_not_found", "files[0].sha256")
    assert not ProofArtifact.objects.exists()


def test_a_batch_file_of_another_step_is_refused_against_the_commitment(
    filed: tuple[APIClient, Proof, Path],
) -> None:
    client, proof, run = filed
    files = _send(client, run, ["files/batch-00000002.u32"])
    files[0]["name"] = "files/batch-00000001.u32"  # step 2's batch under step 1's name
    response = client.post(f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": files}, format="json")
    assert response.status_code == 422, response.content
    error = error_of(response)
    assert error["code"] == "batch_mismatch"
    assert error["detail"] == {"file": "files/batch-00000001.u32", "step": 1}
    assert not ProofArtifact.objects.exists()


def test_a_name_attached_with_other_bytes_is_a_conflict(
    filed: tuple[APIClient, Proof, Path],
) -> None:
    client, proof, run = filed
    first = _send(client, run, ["probes.bin"])
    assert (
        client.post(
            f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": first}, format="json"
        ).status_code
        == 201
    )
    other = _send(client, run, ["files/batch-00000000.u32"])
    clash = [{**other[0], "name": "probes.bin", "kind": "artifact"}]
    response = client.post(f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": clash}, format="json")
    assert response.status_code == 409
    assert error_of(response)["code"] == "artifact_conflict"
    assert ProofArtifact.objects.get(proof=proof, name="probes.bin").sha256 == first[0]["sha256"]


def test_roles_on_challenges_and_artifacts(filed: tuple[APIClient, Proof, Path]) -> None:
    client, proof, run = filed
    acme = Organization.objects.get(slug=ORG)
    evil = Organization.objects.create(slug="evil", name="Evil")
    office = Organization.objects.create(
        slug="eu-office", name="EU AI Office", kind=OrganizationKind.AGENCY
    )
    auditor = _member("bob", acme, Role.AUDITOR)
    regulator = _member("carol", office, Role.REGULATOR)
    outsider = _member("mallory", evil, Role.TRAINER)
    admin = _member("root", acme, Role.ADMIN)
    files = _send(client, run, ["probes.bin"])
    challenges = f"/api/v1/proofs/{proof.pk}/challenges/"
    artifacts = f"/api/v1/proofs/{proof.pk}/artifacts/"
    assert auditor.get(challenges).status_code == 200
    assert regulator.get(challenges).status_code == 200  # claims, not artifacts
    assert outsider.get(challenges).status_code == 404
    assert APIClient().get(challenges).status_code in (401, 403)
    assert auditor.get(artifacts).status_code == 403
    assert regulator.get(artifacts).status_code == 403
    assert outsider.get(artifacts).status_code == 404
    assert auditor.post(artifacts, {"files": files}, format="json").status_code == 403
    assert regulator.post(artifacts, {"files": files}, format="json").status_code == 403
    assert outsider.post(artifacts, {"files": files}, format="json").status_code == 404
    assert not ProofArtifact.objects.exists()
    assert admin.post(artifacts, {"files": files}, format="json").status_code == 201
    listed = client.get(artifacts).json()
    assert [a["name"] for a in listed] == ["probes.bin"]


def test_the_periodic_expiry_rejects_an_unanswered_proof(
    filed: tuple[APIClient, Proof, Path],
) -> None:
    from attestations.challenges.tasks import expire_challenges

    _, proof, _ = filed
    assert expire_challenges() == 0
    Proof.objects.filter(pk=proof.pk).update(challenge_deadline=proof.created)
    assert expire_challenges() == 8
    proof.refresh_from_db()
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "challenge_expired")
    assert proof.field == "challenges.step[0]" and proof.revealed_seed
    assert set(proof.challenges.values_list("status", flat=True)) == {ChallengeStatus.EXPIRED}
    assert expire_challenges() == 0


def test_the_proof_page_shows_challenges_and_a_timeline(
    filed: tuple[APIClient, Proof, Path], django_capture_on_commit_callbacks: Any
) -> None:
    from django.test import Client as PageClient

    client, proof, run = filed
    acme = Organization.objects.get(slug=ORG)
    auditor = User.objects.create_user("bob", "bob@example.org", "x" * 20)
    Membership.objects.create(user=auditor, organization=acme, role=Role.AUDITOR)
    page = PageClient()
    page.force_login(auditor)
    html = page.get(f"/proofs/{proof.pk}/").content.decode()
    assert 'http-equiv="refresh"' in html  # not final: the page refreshes itself
    assert "Replaying challenged steps" in html
    assert html.count('class="c-pending"') == 8
    genesis = Challenge.objects.get(proof=proof, step=0)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            f"/api/v1/proofs/{proof.pk}/artifacts/",
            {"files": _send(client, run, genesis.needed_files)},
            format="json",
        )
    html = page.get(f"/proofs/{proof.pk}/").content.decode()
    assert "<title>step 0: passed</title>" in html
    assert html.count('class="c-pending"') == 7
    assert 'id="challenge-0"' in html and "bit for bit" in html
    Proof.objects.filter(pk=proof.pk).update(challenge_deadline=proof.created)
    html = page.get(f"/proofs/{proof.pk}/").content.decode()
    assert 'http-equiv="refresh"' not in html
    assert "Abandoned: <code>challenge_expired</code>" in html
    assert "<title>step 1: expired (challenge_expired)</title>" in html
    assert proof.challenge_seed in html  # revealed with the verdict


def test_a_blob_damaged_in_storage_is_a_recorded_replay_error(
    filed: tuple[APIClient, Proof, Path], django_capture_on_commit_callbacks: Any
) -> None:
    """Not the trainer's fault and not worth a retry: the challenge records why."""
    from attestations.uploads.models import Blob

    client, proof, run = filed
    genesis = Challenge.objects.get(proof=proof, step=0)
    files = _send(client, run, genesis.needed_files)
    probes = next(f for f in files if f["name"] == "probes.bin")
    blob = Blob.objects.get(sha256=probes["sha256"])
    from django.core.files.storage import default_storage

    damaged = bytes(blob.size)  # same size, other bytes
    with default_storage.open(blob.storage_name, "wb") as handle:
        handle.write(damaged)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": files}, format="json"
        )
    assert response.status_code == 201, response.content
    genesis.refresh_from_db()
    assert (genesis.status, genesis.reason, genesis.attempts) == ("error", "blob_corrupt", 1)
    assert f"reads back as sha256:{sha256(damaged)}" in genesis.message
    proof.refresh_from_db()
    assert proof.status == ProofStatus.CHALLENGED  # the other challenges are still open


def _flaky_replay(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[tuple[int, int]]:
    """Make the first ``failures`` replays meet a storage outage (an ``OSError``).

    Fault injection, not a stand-in: after the outage the real replay runs. Returns
    ``(challenge id, attempts)`` as each replay found them, faulted or not: a retry can
    only claim the challenge again if the failed try gave its claim back.
    """
    from attestations.challenges import execution

    real = execution.replay_one
    hit: list[tuple[int, int]] = []

    def replay_one(challenge: Challenge) -> Any:
        hit.append((challenge.pk, challenge.attempts))
        if len(hit) <= failures:
            raise OSError(5, "Input/output error", "media/blobs")
        return real(challenge)

    monkeypatch.setattr(execution, "replay_one", replay_one)
    return hit


def _audit(challenge: Challenge, action: str) -> int:
    return AuditEvent.objects.filter(
        action=action, target_type="challenge", target_id=str(challenge.pk)
    ).count()


def _attach_unqueued(client: APIClient, proof: Proof, run: Path, challenge: Challenge) -> None:
    """Attach a challenge's files without sending its replay: the test drives the task."""
    files = _send(client, run, challenge.needed_files)
    response = client.post(f"/api/v1/proofs/{proof.pk}/artifacts/", {"files": files}, format="json")
    assert response.status_code == 201, response.content
    challenge.refresh_from_db()
    assert challenge.status == ChallengeStatus.READY


def test_a_transient_storage_error_releases_the_claim_and_the_retry_replays(
    filed: tuple[APIClient, Proof, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry path: the claim is given back, the retry claims it again and replays.

    Applied in-process, Celery runs a retry at once rather than after its backoff.
    """
    from attestations.challenges.tasks import replay_challenge

    client, proof, run = filed
    genesis = Challenge.objects.get(proof=proof, step=0)
    _attach_unqueued(client, proof, run, genesis)
    hit = _flaky_replay(monkeypatch, failures=1)
    result = replay_challenge.apply(args=[genesis.pk], throw=False)
    assert (result.state, result.result) == ("SUCCESS", "passed")
    assert hit == [(genesis.pk, 1), (genesis.pk, 2)]  # the retry took the claim again
    genesis.refresh_from_db()
    assert (genesis.status, genesis.reason, genesis.attempts) == ("passed", "", 2)
    assert genesis.steps_replayed >= 1
    assert _audit(genesis, "challenge.passed") == 1
    assert _audit(genesis, "challenge.failed") == 0
    assert replay_challenge.apply(args=[genesis.pk]).get() is None  # final: a no-op


def test_a_storage_outage_past_every_retry_is_a_recorded_error(
    filed: tuple[APIClient, Proof, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from attestations.challenges.tasks import replay_challenge

    client, proof, run = filed
    genesis = Challenge.objects.get(proof=proof, step=0)
    _attach_unqueued(client, proof, run, genesis)
    hit = _flaky_replay(monkeypatch, failures=1)
    # The broker's last redelivery: Celery counts the retries already made.
    retries = replay_challenge.max_retries
    result = replay_challenge.apply(args=[genesis.pk], retries=retries, throw=False)
    assert result.state == "FAILURE" and isinstance(result.result, OSError)
    assert hit == [(genesis.pk, 1)]
    genesis.refresh_from_db()
    assert (genesis.status, genesis.reason) == ("error", "replay_unavailable")
    assert "OSError" in genesis.message and "Input/output error" in genesis.message
    assert _audit(genesis, "challenge.passed") == _audit(genesis, "challenge.failed") == 0
    proof.refresh_from_db()
    assert proof.status == ProofStatus.CHALLENGED  # the other challenges are still open
