"""Resumable, content-addressed uploads: every failure is a precise 4xx that stores nothing."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from rest_framework.test import APIClient

from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import (
    World,
    error_of,
    open_upload,
    put_parts,
    sha256,
    stored_files,
    upload_blob,
)

Api = Callable[[str | None], APIClient]
# The world fixture stores one blob (the proof's transcript); nothing else may appear.
BASELINE = 1


def test_it_works(world: World, api: Api, storage: Path) -> None:
    data = os.urandom(2500)
    response = upload_blob(api("alice"), data)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "complete"
    assert body["blob_sha256"] == sha256(data)
    blob = Blob.objects.get(sha256=sha256(data))
    assert (storage / blob.storage_name).read_bytes() == data
    assert blob.storage_name == Blob.address(sha256(data))
    assert not any(name.startswith("staging/") for name in stored_files(storage))
    assert UploadPart.objects.count() == 0


def test_it_resumes_after_an_interruption(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    data = os.urandom(3000)
    created = open_upload(client, data)
    # The connection drops after the first two parts.
    put_parts(client, created["id"], data[:2000], 1000)
    state = client.get(f"/api/v1/uploads/{created['id']}/").json()
    assert [p["number"] for p in state["parts"]] == [1, 2]
    assert state["received_bytes"] == 2000
    # Completing now names what is missing, and the upload stays open.
    early = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert early.status_code == 409  # the upload's state, not the request, is at fault
    assert error_of(early)["code"] == "size_mismatch"
    # Resume: resend part 2 (a retried request is harmless), then send part 3.
    chunk2, chunk3 = data[1000:2000], data[2000:]
    again = client.put(
        f"/api/v1/uploads/{created['id']}/parts/2/",
        data=chunk2,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(chunk2),
    )
    assert again.status_code == 200
    last = client.put(
        f"/api/v1/uploads/{created['id']}/parts/3",
        data=chunk3,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(chunk3),
    )
    assert last.status_code == 200
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    blob = Blob.objects.get(sha256=sha256(data))
    assert (storage / blob.storage_name).read_bytes() == data
    # A retried completion returns the same result.
    assert client.post(f"/api/v1/uploads/{created['id']}/complete/").json()["status"] == "complete"
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_it_names_missing_parts(world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(3000)
    created = open_upload(client, data)
    responses = put_parts(client, created["id"], data, 1000)
    assert all(r.status_code == 200 for r in responses)
    UploadPart.objects.filter(upload_id=created["id"], number=2).delete()
    response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "missing_parts"
    assert error["detail"]["missing"] == [2]
    assert Upload.objects.get(pk=created["id"]).status == UploadStatus.OPEN


def test_it_rejects_a_wrong_part_digest(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    data = os.urandom(1500)
    created = open_upload(client, data)
    before = stored_files(storage)
    wrong = "0" * 64
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=data[:1000],
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=wrong,
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "part_digest_mismatch"
    assert error["field"] == "X-Part-SHA256"
    assert error["detail"] == {"expected": wrong, "got": sha256(data[:1000])}
    assert wrong in error["message"] and sha256(data[:1000]) in error["message"]
    assert stored_files(storage) == before
    assert UploadPart.objects.count() == 0
    assert not list((storage.parent / "tmp").glob("*"))


def test_it_requires_the_part_digest_header(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    created = open_upload(client, b"hello world")
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=b"hello world",
        content_type="application/octet-stream",
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "missing_part_digest"
    assert error_of(response)["field"] == "X-Part-SHA256"
    assert UploadPart.objects.count() == 0


def test_it_rejects_a_wrong_total_digest(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    data = os.urandom(2000)
    declared = sha256(b"something else")
    created = open_upload(client, data, digest=declared)
    put_parts(client, created["id"], data, 1000)
    blobs_before = Blob.objects.count()
    response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "blob_digest_mismatch"
    assert error["field"] == "sha256"
    assert error["detail"] == {"expected": declared, "got": sha256(data)}
    # Nothing stored: no blob row, no file under blobs/ or staging/, no parts, no temp.
    assert Blob.objects.count() == blobs_before
    assert len(stored_files(storage)) == BASELINE
    assert UploadPart.objects.count() == 0
    assert not list((storage.parent / "tmp").glob("*"))
    upload = Upload.objects.get(pk=created["id"])
    assert (upload.status, upload.reason) == (UploadStatus.FAILED, "blob_digest_mismatch")
    # A failed upload takes no more parts.
    late = put_parts(client, created["id"], data[:10], 10)[0]
    assert late.status_code == 409
    assert error_of(late)["code"] == "upload_not_open"


def test_it_deduplicates_identical_blobs(world: World, api: Api, storage: Path) -> None:
    data = os.urandom(1800)
    first = upload_blob(api("alice"), data)
    second = upload_blob(api("admin"), data, part_size=600)
    assert first.status_code == second.status_code == 200
    assert first.json()["blob_sha256"] == second.json()["blob_sha256"]
    assert Blob.objects.filter(sha256=sha256(data)).count() == 1
    assert Upload.objects.filter(blob__sha256=sha256(data)).count() == 2
    assert len(stored_files(storage)) == BASELINE + 1
    assert UploadPart.objects.count() == 0


def test_it_rejects_an_oversized_part(
    world: World, api: Api, storage: Path, settings: object
) -> None:
    client = api("alice")
    limit = 64 * 1024  # MAX_PART_BYTES in the storage fixture
    data = os.urandom(limit + 1)
    created = open_upload(client, data)
    before = stored_files(storage)
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=data,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(data),
    )
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "part_too_large"
    assert error["detail"]["limit"] == limit
    assert stored_files(storage) == before
    assert UploadPart.objects.count() == 0


def test_it_rejects_an_oversized_body_without_content_length(
    world: World, api: Api, storage: Path
) -> None:
    """The limit holds while streaming, not only by trusting Content-Length."""
    from io import BytesIO

    from attestations.core.errors import PayloadTooLargeError
    from attestations.uploads.parts import put_part

    upload = Upload.objects.get(pk=open_upload(api("alice"), os.urandom(70 * 1024))["id"])
    body = os.urandom(64 * 1024 + 1)
    try:
        put_part(upload, 1, stream=BytesIO(body), declared_sha256=sha256(body), content_length=None)
    except PayloadTooLargeError as error:
        assert error.error_code == "part_too_large"
    else:
        raise AssertionError("no PayloadTooLargeError")
    assert UploadPart.objects.count() == 0
    assert len(stored_files(storage)) == BASELINE


def test_it_rejects_an_oversized_blob(world: World, api: Api) -> None:
    response = api("alice").post(
        "/api/v1/uploads/",
        {
            "experiment": "acme/run-1",
            "kind": "artifact",
            "size": 2 * 1024 * 1024,
            "sha256": "a" * 64,
        },
        format="json",
    )
    assert response.status_code == 400  # the declaration is wrong, not a large body
    error = error_of(response)
    assert (error["code"], error["field"]) == ("blob_too_large", "size")
    assert Upload.objects.count() == 1  # only the world's


def test_parts_cannot_exceed_the_declared_size(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    created = open_upload(client, b"x" * 100)
    response = put_parts(client, created["id"], b"y" * 101, 1000)[0]
    assert response.status_code == 409
    assert error_of(response)["code"] == "size_exceeded"
    assert UploadPart.objects.count() == 0


def test_it_validates_the_declaration(world: World, api: Api) -> None:
    response = api("alice").post(
        "/api/v1/uploads/",
        {"experiment": "acme/run-1", "kind": "weights", "size": 3, "sha256": "xyz"},
        format="json",
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["field"] == "kind"
    assert set(error["detail"]) == {"kind", "sha256"}


def test_abort_removes_staged_parts(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    data = os.urandom(1500)
    created = open_upload(client, data)
    put_parts(client, created["id"], data[:1000], 1000)
    assert any(name.startswith("staging/") for name in stored_files(storage))
    response = client.post(f"/api/v1/uploads/{created['id']}/abort/")
    assert response.status_code == 200
    assert response.json()["status"] == "aborted"
    assert not any(name.startswith("staging/") for name in stored_files(storage))
    assert UploadPart.objects.count() == 0
    assert client.post(f"/api/v1/uploads/{created['id']}/abort/").status_code == 200


def test_expired_uploads_are_cleaned(world: World, api: Api, storage: Path) -> None:
    from django.utils import timezone

    from attestations.uploads import services as uploads

    client = api("alice")
    data = os.urandom(1500)
    created = open_upload(client, data)
    put_parts(client, created["id"], data[:1000], 1000)
    assert uploads.expire_stale(timezone.now() + timezone.timedelta(days=30)) == 2
    assert not any(name.startswith("staging/") for name in stored_files(storage))
    assert Upload.objects.get(pk=created["id"]).reason == "expired"


def _claim_completion(upload_id: str, size: int) -> datetime:
    """Leave an upload as a request that claimed its completion does: ``completing``, its
    lease (:func:`attestations.uploads.services.completion_lease`) in ``expires``; returns
    the lease's end."""
    from django.utils import timezone

    from attestations.uploads.services import completion_lease

    until = timezone.now() + completion_lease(size)
    Upload.objects.filter(pk=upload_id).update(status=UploadStatus.COMPLETING, expires=until)
    return until


def test_a_completion_whose_worker_died_is_reopened_after_its_lease(
    world: World, api: Api, storage: Path
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from attestations.audit.models import AuditEvent
    from attestations.uploads import services as uploads

    client = api("alice")
    data = os.urandom(2500)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    # What a worker killed mid-completion leaves: the claim committed, nothing after it.
    claimed = _claim_completion(created["id"], len(data))
    refused = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert refused.status_code == 409, refused.content
    # Within the lease the claim is a live worker's: left alone.
    assert uploads.expire_stale(claimed - timedelta(seconds=1)) == 0
    assert Upload.objects.get(pk=created["id"]).status == UploadStatus.COMPLETING
    # Past it, reopened with its parts (not expired: the client's retry completes it).
    assert uploads.expire_stale(claimed + timedelta(seconds=1)) == 0
    reopened = Upload.objects.get(pk=created["id"])
    assert reopened.status == UploadStatus.OPEN and reopened.expires > timezone.now()
    assert reopened.parts.count() == 3
    assert AuditEvent.objects.filter(action="upload.reopened").count() == 1
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    assert (storage / Blob.objects.get(sha256=sha256(data)).storage_name).read_bytes() == data


def test_a_completion_lease_grows_with_the_upload() -> None:
    from attestations.uploads.services import completion_lease

    assert completion_lease(0).total_seconds() == 600
    # A terabyte hashed and joined at 32 MiB/s: about nine and a half hours.
    assert 9 * 3600 < completion_lease(1 << 40).total_seconds() < 10 * 3600


def test_a_single_part_is_moved_into_place(world: World, api: Api, storage: Path) -> None:
    data = os.urandom(800)
    assert upload_blob(api("alice"), data).status_code == 200
    assert upload_blob(api("admin"), data).status_code == 200  # deduplicated
    blob = Blob.objects.get(sha256=sha256(data))
    assert (storage / blob.storage_name).read_bytes() == data
    assert len(stored_files(storage)) == BASELINE + 1
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_a_single_part_with_a_wrong_total_digest_stores_nothing(
    world: World, api: Api, storage: Path
) -> None:
    client = api("alice")
    data = os.urandom(800)
    created = open_upload(client, data, digest=sha256(b"other"))
    put_parts(client, created["id"], data, 1000)
    response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 400
    assert error_of(response)["code"] == "blob_digest_mismatch"
    assert len(stored_files(storage)) == BASELINE
    assert not Blob.objects.filter(sha256=sha256(data)).exists()


def test_the_expiry_task_is_idempotent(world: World, api: Api, storage: Path) -> None:
    from django.utils import timezone

    from attestations.uploads.tasks import expire_uploads

    Upload.objects.update(expires=timezone.now() - timezone.timedelta(seconds=1))
    assert expire_uploads() == 1
    assert expire_uploads() == 0


def test_an_empty_part_is_refused(world: World, api: Api) -> None:
    client = api("alice")
    created = open_upload(client, b"abc")
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=b"",
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(b""),
        CONTENT_LENGTH="0",  # the test client omits it for an empty body; HTTP clients send it
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "empty_part"
    assert UploadPart.objects.count() == 0


def test_a_body_of_unknown_length_is_refused(world: World, api: Api) -> None:
    client = api("alice")
    created = open_upload(client, b"abc")
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/", HTTP_X_PART_SHA256=sha256(b"abc")
    )
    assert response.status_code == 411
    assert error_of(response)["field"] == "Content-Length"


# --- Reservations and states under concurrency (issue 34; the races: tests/reliability) ---


def test_bytes_in_flight_count_against_the_declared_size(
    world: World, api: Api, storage: Path
) -> None:
    from attestations.uploads.models import PartReservation

    client = api("alice")
    data = os.urandom(2000)
    created = open_upload(client, data)
    # Another request is sending 1,500 bytes of part 2 right now.
    PartReservation.objects.create(upload_id=created["id"], number=2, size=1500)
    response = put_parts(client, created["id"], data[:1000], 1000)[0]
    assert response.status_code == 409
    error = error_of(response)
    assert (error["code"], error["field"]) == ("size_exceeded", "body")
    assert error["detail"] == {"expected": 2000, "got": 2500}
    assert "received and in flight would hold 2500 bytes" in error["message"]
    assert UploadPart.objects.count() == 0
    assert PartReservation.objects.count() == 1  # the other request's, untouched
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_a_reservation_left_by_a_dead_request_lapses(world: World, api: Api, storage: Path) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from attestations.uploads.models import PartReservation
    from attestations.uploads.parts import RESERVATION_SECONDS

    client = api("alice")
    data = os.urandom(2000)
    created = open_upload(client, data)
    PartReservation.objects.create(
        upload_id=created["id"],
        number=2,
        size=2000,
        created=timezone.now() - timedelta(seconds=RESERVATION_SECONDS + 1),
    )
    for response in put_parts(client, created["id"], data, 1000):
        assert response.status_code == 200, response.content
    assert PartReservation.objects.count() == 0  # lapsed, and each part's released
    assert client.post(f"/api/v1/uploads/{created['id']}/complete/").status_code == 200


def test_a_part_sent_again_to_a_full_upload_replaces_it(
    world: World, api: Api, storage: Path
) -> None:
    client = api("alice")
    data = os.urandom(2000)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    again = put_parts(client, created["id"], data[:1000], 1000)[0]  # a retried PUT
    assert again.status_code == 200, again.content
    staged = [name for name in stored_files(storage) if name.startswith("staging/")]
    assert len(staged) == 2
    assert client.post(f"/api/v1/uploads/{created['id']}/complete/").status_code == 200


def test_a_completing_upload_refuses_parts_abort_and_expiry(
    world: World, api: Api, storage: Path
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from attestations.uploads import services as uploads

    client = api("alice")
    data = os.urandom(2000)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    # Another request has claimed the completion and is assembling the parts.
    _claim_completion(created["id"], 2000)
    staged = sorted(name for name in stored_files(storage) if name.startswith("staging/"))
    part = put_parts(client, created["id"], data[:1000], 1000)[0]
    aborted = client.post(f"/api/v1/uploads/{created['id']}/abort/")
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    for response, action in ((part, "parts can only be sent"), (aborted, "aborted"), (done, "")):
        assert response.status_code == 409, response.content
        error = error_of(response)
        assert (error["code"], error["field"]) == ("upload_not_open", "status")
        assert error["detail"] == {"status": "completing"}
        assert "is completing; " in error["message"] and action in error["message"]
    # Within its lease the claim is left alone (past it: the test above).
    assert uploads.expire_stale(timezone.now() + timedelta(minutes=5)) == 0
    assert Upload.objects.get(pk=created["id"]).status == UploadStatus.COMPLETING
    assert sorted(n for n in stored_files(storage) if n.startswith("staging/")) == staged
    assert UploadPart.objects.filter(upload_id=created["id"]).count() == 2
