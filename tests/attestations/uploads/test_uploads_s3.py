"""Uploads with S3 storage (``DVBENCH_S3_BUCKET``), against a real S3 API (moto_server).

The same contract as on local disk (``test_uploads.py``): parts staged under
``staging/uploads/<id>/``, the blob stored once under its content address, every refusal
a precise 4xx that leaves the bucket as it was. Each test has a bucket of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from attestations.uploads import services as uploads
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World, error_of, open_upload, put_parts, sha256, upload_blob
from tests.attestations.s3 import S3

Api = Callable[[str | None], APIClient]


def test_it_works(s3: S3, world: World, api: Api) -> None:
    data = os.urandom(2500)
    response = upload_blob(api("alice"), data)
    assert response.status_code == 200, response.content
    assert response.json()["blob_sha256"] == sha256(data)
    blob = Blob.objects.get(sha256=sha256(data))
    assert blob.storage_name == Blob.address(sha256(data))
    assert s3.read(blob.storage_name) == data
    assert s3.keys("staging/") == []
    assert UploadPart.objects.count() == 0


def test_it_resumes_after_a_crash(s3: S3, world: World, api: Api) -> None:
    data = os.urandom(3000)
    created = open_upload(api("alice"), data)
    put_parts(api("alice"), created["id"], data[:2000], 1000)
    # The client died after two parts; a new one asks what the platform holds.
    client = api("alice")
    state = client.get(f"/api/v1/uploads/{created['id']}/").json()
    assert [(p["number"], p["sha256"]) for p in state["parts"]] == [
        (1, sha256(data[:1000])),
        (2, sha256(data[1000:2000])),
    ]
    assert len(s3.keys(f"staging/uploads/{created['id']}/")) == 2
    last = data[2000:]
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/3/",
        data=last,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(last),
    )
    assert response.status_code == 200, response.content
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    assert s3.read(Blob.address(sha256(data))) == data
    assert s3.keys("staging/") == []


def test_a_wrong_part_digest_stores_nothing(s3: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(1500)
    created = open_upload(client, data)
    before = s3.keys()
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=data[:1000],
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256="0" * 64,
    )
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("part_digest_mismatch", "X-Part-SHA256")
    assert error["detail"] == {"expected": "0" * 64, "got": sha256(data[:1000])}
    assert s3.keys() == before
    assert UploadPart.objects.count() == 0


def test_a_wrong_whole_digest_fails_the_upload(s3: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(2000)
    declared = sha256(b"something else")
    created = open_upload(client, data, digest=declared)
    put_parts(client, created["id"], data, 1000)
    before = set(s3.keys("blobs/"))
    response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("blob_digest_mismatch", "sha256")
    assert error["detail"] == {"expected": declared, "got": sha256(data)}
    assert set(s3.keys("blobs/")) == before
    assert s3.keys("staging/") == []
    upload = Upload.objects.get(pk=created["id"])
    assert (upload.status, upload.reason) == (UploadStatus.FAILED, "blob_digest_mismatch")


def test_a_part_larger_than_declared_is_refused(s3: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(1500)
    created = open_upload(client, data)
    too_much = os.urandom(2000)
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=too_much,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(too_much),
    )
    assert response.status_code == 409
    error = error_of(response)
    assert (error["code"], error["field"]) == ("size_exceeded", "body")
    assert error["detail"] == {"expected": 1500, "got": 2000}
    assert s3.keys("staging/") == []


def test_a_part_over_the_part_limit_is_refused(s3: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(64 * 1024 + 1)  # the storage fixture's MAX_PART_BYTES, plus one
    created = open_upload(client, data)
    response = put_parts(client, created["id"], data, len(data))[0]
    assert response.status_code == 413
    assert (error_of(response)["code"], error_of(response)["field"]) == (
        "part_too_large",
        "Content-Length",
    )
    assert s3.keys("staging/") == []


def test_abort_and_expiry_remove_the_staged_parts(s3: S3, world: World, api: Api) -> None:
    client = api("alice")
    aborted, expired = os.urandom(1500), os.urandom(1500)
    first = open_upload(client, aborted)
    put_parts(client, first["id"], aborted[:1000], 1000)
    second = open_upload(client, expired)
    put_parts(client, second["id"], expired[:1000], 1000)
    assert len(s3.keys("staging/")) == 2
    assert client.post(f"/api/v1/uploads/{first['id']}/abort/").status_code == 200
    assert s3.keys("staging/") == [s3.keys("staging/")[0]]
    assert s3.keys("staging/")[0].startswith(f"staging/uploads/{second['id']}/")
    assert uploads.expire_stale(timezone.now() + timedelta(days=30)) >= 1
    assert s3.keys("staging/") == []
    assert Upload.objects.get(pk=second["id"]).reason == "expired"


def test_identical_blobs_are_stored_once(s3: S3, world: World, api: Api) -> None:
    data = os.urandom(1800)
    first = upload_blob(api("alice"), data)
    second = upload_blob(api("admin"), data, part_size=600)
    assert first.status_code == second.status_code == 200
    assert s3.keys(Blob.address(sha256(data))) == [Blob.address(sha256(data))]
    assert Upload.objects.filter(blob__sha256=sha256(data)).count() == 2
    assert s3.keys("staging/") == []
