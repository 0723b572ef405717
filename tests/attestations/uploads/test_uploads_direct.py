"""Direct uploads: parts PUT straight to S3 (moto_server) through presigned URLs.

The web server never receives a part's bytes: the client declares each part (size and
SHA-256) and gets a presigned ``UploadPart`` URL; completion checks what S3 holds against
the declarations from S3's answers alone. moto_server checks neither signatures, nor
expiry, nor ``Content-Length`` or ``x-amz-checksum-sha256`` against the body, so these
tests send what a real S3 would refuse and check that the platform refuses it at
completion, from S3's own listing and checksums, with the error codes of the API path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from django.utils import timezone
from rest_framework.test import APIClient

from attestations.uploads import services as uploads
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World, error_of, open_upload, sha256
from tests.attestations.s3 import S3

Api = Callable[[str | None], APIClient]
MiB = 1024 * 1024
PART = 5 * MiB  # S3's least size of a part but the last


def declare(client: APIClient, upload_id: str, number: int, data: bytes, **override: Any) -> Any:
    body = {"size": len(data), "sha256": sha256(data), **override}
    return client.post(f"/api/v1/uploads/{upload_id}/parts/{number}/url/", body, format="json")


def put(issued: dict[str, Any], data: bytes, *, url: str | None = None) -> httpx.Response:
    """PUT to S3 as the SDK does: the URL and exactly the headers the platform gave."""
    headers = dict(issued["headers"])
    if len(data) != int(headers["Content-Length"]):
        headers.pop("Content-Length")  # a body of another size: say its own length
    return httpx.put(url or issued["url"], content=data, headers=headers)


def send(client: APIClient, upload_id: str, data: bytes, part: int = PART) -> None:
    for number, start in enumerate(range(0, len(data), part), start=1):
        chunk = data[start : start + part]
        issued = declare(client, upload_id, number, chunk)
        assert issued.status_code == 200, issued.content
        assert put(issued.json(), chunk).status_code == 200


def multipart_uploads(s3: S3) -> list[str]:
    answer = s3.client.list_multipart_uploads(Bucket=s3.bucket)
    return [item["UploadId"] for item in answer.get("Uploads", [])]


def test_a_direct_upload_never_passes_through_the_web_server(
    s3_direct: S3, world: World, api: Api
) -> None:
    client = api("alice")
    data = os.urandom(PART + 1000)
    created = open_upload(client, data)
    assert created["direct"] is True
    assert created["min_part_bytes"] == PART
    issued = declare(client, created["id"], 1, data[:PART])
    assert issued.status_code == 200, issued.content
    answer = issued.json()
    assert answer["method"] == "PUT"
    query = parse_qs(urlsplit(answer["url"]).query)
    # The signature covers the object, the upload, the part, its size and its SHA-256.
    assert query["uploadId"] == [Upload.objects.get(pk=created["id"]).s3_upload_id]
    assert query["partNumber"] == ["1"]
    assert query["X-Amz-SignedHeaders"] == ["content-length;host;x-amz-checksum-sha256"]
    assert query["X-Amz-Expires"] == ["900"]
    assert urlsplit(answer["url"]).path.endswith(f"/staging/uploads/{created['id']}/object")
    assert answer["headers"]["Content-Length"] == str(PART)
    assert put(answer, data[:PART]).status_code == 200
    send_last = declare(client, created["id"], 2, data[PART:]).json()
    assert put(send_last, data[PART:]).status_code == 200
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    assert done.json()["blob_sha256"] == sha256(data)
    assert s3_direct.read(Blob.address(sha256(data))) == data
    assert s3_direct.keys("staging/") == []
    assert multipart_uploads(s3_direct) == []
    assert UploadPart.objects.count() == 0


def test_the_api_refuses_parts_of_a_direct_upload(s3_direct: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(1000)
    created = open_upload(client, data)
    response = client.put(
        f"/api/v1/uploads/{created['id']}/parts/1/",
        data=data,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(data),
    )
    assert response.status_code == 409
    assert (error_of(response)["code"], error_of(response)["field"]) == ("direct_upload", "number")


def test_declarations_are_checked(s3_direct: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(2000)
    upload_id = open_upload(client, data)["id"]
    too_big = declare(client, upload_id, 1, data, size=2001)
    assert too_big.status_code == 409
    assert error_of(too_big)["code"] == "size_exceeded"
    assert error_of(too_big)["detail"] == {"expected": 2000, "got": 2001}
    over_limit = declare(client, upload_id, 1, data, size=6 * MiB + 1)
    assert over_limit.status_code == 413
    assert (error_of(over_limit)["code"], error_of(over_limit)["field"]) == (
        "part_too_large",
        "size",
    )
    assert declare(client, upload_id, 0, data).status_code == 400
    assert declare(client, upload_id, 1, data, sha256="xyz").status_code == 400
    assert declare(client, upload_id, 1, data, size="5").status_code == 400


def test_it_resumes_after_a_crash_from_what_s3_holds(s3_direct: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(2 * PART + 10)
    upload_id = open_upload(client, data)["id"]
    first = declare(client, upload_id, 1, data[:PART]).json()
    assert put(first, data[:PART]).status_code == 200
    # Parts 2 and 3 were declared, then the client died before their PUTs.
    assert declare(client, upload_id, 2, data[PART : 2 * PART]).status_code == 200
    assert declare(client, upload_id, 3, data[2 * PART :]).status_code == 200
    state = api("alice").get(f"/api/v1/uploads/{upload_id}/").json()
    assert state["parts"] == [{"number": 1, "size": PART, "sha256": sha256(data[:PART])}]
    assert state["received_bytes"] == PART
    early = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert early.status_code == 409
    assert error_of(early)["code"] == "missing_parts"
    assert error_of(early)["detail"] == {"missing": [2, 3], "received": [1]}
    assert Upload.objects.get(pk=upload_id).status == UploadStatus.OPEN
    # The new process sends only what S3 lacks.
    for number, chunk in ((2, data[PART : 2 * PART]), (3, data[2 * PART :])):
        assert put(declare(client, upload_id, number, chunk).json(), chunk).status_code == 200
    done = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert done.status_code == 200, done.content
    assert s3_direct.read(Blob.address(sha256(data))) == data


def test_a_part_with_other_bytes_than_declared_fails_the_upload(
    s3_direct: S3, world: World, api: Api
) -> None:
    # A real S3 refuses the PUT (its x-amz-checksum-sha256 is signed and checked); moto
    # stores it, and S3's composite checksum at completion shows the difference.
    client = api("alice")
    data = os.urandom(PART + 100)
    upload_id = open_upload(client, data)["id"]
    send(client, upload_id, data[:PART])
    forged = os.urandom(100)
    issued = declare(client, upload_id, 2, data[PART:]).json()
    assert put(issued, forged).status_code == 200  # moto does not check the checksum
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert (error["code"], error["field"]) == ("part_digest_mismatch", "parts")
    upload = Upload.objects.get(pk=upload_id)
    assert (upload.status, upload.reason) == (UploadStatus.FAILED, "part_digest_mismatch")
    assert not Blob.objects.filter(sha256=sha256(data)).exists()
    assert s3_direct.keys("blobs/") == [Blob.address(sha256(b"not really a transcript"))]
    assert s3_direct.keys("staging/") == []
    assert multipart_uploads(s3_direct) == []


def test_a_part_larger_than_declared_fails_the_upload(
    s3_direct: S3, world: World, api: Api
) -> None:
    # A real S3 refuses a body longer than the signed Content-Length; moto stores it.
    client = api("alice")
    data = os.urandom(1000)
    upload_id = open_upload(client, data)["id"]
    issued = declare(client, upload_id, 1, data).json()
    assert put(issued, data + b"1234").status_code == 200
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 409, response.content
    error = error_of(response)
    assert (error["code"], error["field"]) == ("size_exceeded", "parts")
    assert error["detail"] == {"part": 1, "expected": 1000, "got": 1004}
    assert Upload.objects.get(pk=upload_id).status == UploadStatus.FAILED
    assert s3_direct.keys("staging/") == []
    assert multipart_uploads(s3_direct) == []


def test_a_wrong_whole_digest_fails_the_upload(s3_direct: S3, world: World, api: Api) -> None:
    client = api("alice")
    data = os.urandom(1500)
    declared = sha256(b"someone else's blob")
    upload_id = open_upload(client, data, digest=declared)["id"]
    send(client, upload_id, data)
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("blob_digest_mismatch", "sha256")
    assert error["detail"] == {"expected": declared, "got": sha256(data)}
    assert not s3_direct.keys(Blob.address(declared))
    assert s3_direct.keys("staging/") == []


def test_another_organisation_gets_no_url_and_a_borrowed_url_is_caught(
    s3_direct: S3, world: World, api: Api
) -> None:
    alice, mallory = api("alice"), api("mallory")
    data = os.urandom(800)
    victim = open_upload(alice, data)["id"]
    assert declare(mallory, victim, 1, data).status_code == 404
    assert declare(api("bob"), victim, 1, data).status_code == 403  # an auditor of acme
    # mallory's own URL, pointed at alice's S3 upload: real S3 refuses the signature
    # (the upload id is signed); moto stores the part, and alice's completion catches it.
    theirs = open_upload(mallory, data, experiment="evil/heist")["id"]
    forged = os.urandom(800)
    issued = declare(mallory, theirs, 1, forged).json()
    url = issued["url"].replace(
        Upload.objects.get(pk=theirs).s3_upload_id, Upload.objects.get(pk=victim).s3_upload_id
    )
    url = url.replace(f"uploads/{theirs}/", f"uploads/{victim}/")
    assert put(issued, forged, url=url).status_code == 200
    assert declare(alice, victim, 1, data).status_code == 200
    response = alice.post(f"/api/v1/uploads/{victim}/complete/")
    assert response.status_code == 400
    assert error_of(response)["code"] == "part_digest_mismatch"
    assert not Blob.objects.filter(sha256=sha256(data)).exists()


def test_a_part_sent_after_its_url_expired_is_refused(
    s3_direct: S3, world: World, api: Api, settings: Any
) -> None:
    # moto accepts an expired URL; S3 reports when each part arrived, and the platform
    # refuses parts that arrived after their URL's expiry. The upload stays open.
    settings.DVBENCH = {**settings.DVBENCH, "S3_PRESIGN_SECONDS": 10}
    client = api("alice")
    data = os.urandom(700)
    upload_id = open_upload(client, data)["id"]
    issued = declare(client, upload_id, 1, data).json()
    assert parse_qs(urlsplit(issued["url"]).query)["X-Amz-Expires"] == ["10"]
    UploadPart.objects.filter(upload_id=upload_id).update(
        created=timezone.now() - timedelta(hours=1)
    )
    assert put(issued, data).status_code == 200
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 409
    error = error_of(response)
    assert (error["code"], error["detail"]) == ("part_url_expired", {"parts": [1]})
    assert Upload.objects.get(pk=upload_id).status == UploadStatus.OPEN
    # A fresh URL, the part again: accepted.
    assert put(declare(client, upload_id, 1, data).json(), data).status_code == 200
    assert client.post(f"/api/v1/uploads/{upload_id}/complete/").status_code == 200


def test_identical_blobs_are_stored_once_and_each_is_verified(
    s3_direct: S3, world: World, api: Api
) -> None:
    data = os.urandom(900)
    for user in ("alice", "admin"):
        client = api(user)
        upload_id = open_upload(client, data)["id"]
        send(client, upload_id, data)
        assert client.post(f"/api/v1/uploads/{upload_id}/complete/").status_code == 200
    assert s3_direct.keys(Blob.address(sha256(data))) == [Blob.address(sha256(data))]
    assert Upload.objects.filter(blob__sha256=sha256(data)).count() == 2
    # Claiming a stored digest without its bytes gets nothing.
    client = api("alice")
    upload_id = open_upload(client, os.urandom(900), digest=sha256(data))["id"]
    send(client, upload_id, os.urandom(900))
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert error_of(response)["code"] == "blob_digest_mismatch"
    assert s3_direct.read(Blob.address(sha256(data))) == data


def test_abort_and_expiry_discard_what_s3_holds(s3_direct: S3, world: World, api: Api) -> None:
    client = api("alice")
    aborted, expired = os.urandom(600), os.urandom(600)
    first = open_upload(client, aborted)["id"]
    send(client, first, aborted)
    second = open_upload(client, expired)["id"]
    send(client, second, expired)
    assert len(multipart_uploads(s3_direct)) == 2
    assert client.post(f"/api/v1/uploads/{first}/abort/").status_code == 200
    assert multipart_uploads(s3_direct) == [Upload.objects.get(pk=second).s3_upload_id]
    assert declare(client, first, 1, aborted).status_code == 409
    assert uploads.expire_stale(timezone.now() + timedelta(days=30)) >= 1
    assert multipart_uploads(s3_direct) == []
    assert Upload.objects.get(pk=second).reason == "expired"


def test_above_the_copy_limit_the_worker_hashes_the_object(
    s3_direct: S3, world: World, api: Api, settings: Any
) -> None:
    settings.DVBENCH = {**settings.DVBENCH, "S3_COPY_MAX_BYTES": 100}
    client = api("alice")
    data = os.urandom(1200)
    upload_id = open_upload(client, data)["id"]
    send(client, upload_id, data)
    done = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert done.status_code == 200, done.content
    assert s3_direct.read(Blob.address(sha256(data))) == data


def test_parts_below_s3_least_size_are_refused_before_s3_is_asked(
    s3_direct: S3, world: World, api: Api
) -> None:
    client = api("alice")
    data = os.urandom(1500)
    upload_id = open_upload(client, data)["id"]
    send(client, upload_id, data, part=1000)
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 409
    error = error_of(response)
    assert (error["code"], error["detail"]) == ("part_too_small", {"parts": [1], "minimum": PART})
    assert Upload.objects.get(pk=upload_id).status == UploadStatus.OPEN


def test_urls_name_the_endpoint_clients_reach(
    s3_direct: S3, world: World, api: Api, settings: Any
) -> None:
    # The platform reaches S3 at 127.0.0.1; the clients, here, at localhost.
    public = s3_direct.endpoint.replace("127.0.0.1", "localhost")
    settings.DVBENCH = {**settings.DVBENCH, "S3_PUBLIC_ENDPOINT_URL": public}
    client = api("alice")
    data = os.urandom(600)
    upload_id = open_upload(client, data)["id"]
    issued = declare(client, upload_id, 1, data).json()
    assert issued["url"].startswith(f"{public}/")
    assert put(issued, data).status_code == 200
    assert client.post(f"/api/v1/uploads/{upload_id}/complete/").status_code == 200
