"""Completion on local disk: the kernel joins the parts while the platform hashes them."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.uploads import blobs, disk, sha256state
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World, error_of, open_upload, put_parts, sha256, stored_files

Api = Callable[[str | None], APIClient]


def _refuse(code: int) -> Callable[..., int]:
    def copy_file_range(*args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code))

    return copy_file_range


def _put_last_first(client: APIClient, upload_id: str, data: bytes, size: int) -> None:
    """The last part before the others: it lies in a file of its own, so completion joins
    the pieces (the parts sent in order lie end to end in the data file)."""
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    for number in (len(chunks), *range(1, len(chunks))):
        _put(client, upload_id, number, chunks[number - 1])


def test_parts_are_joined_where_copy_file_range_is_missing(
    world: World, api: Api, storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.ENOSYS))
    data = os.urandom(3500)
    created = open_upload(api("alice"), data)
    _put_last_first(api("alice"), created["id"], data, 1000)
    response = api("alice").post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 200, response.content
    blob = Blob.objects.get(sha256=sha256(data))
    assert (storage / blob.storage_name).read_bytes() == data


def test_a_full_disk_while_joining_keeps_the_upload_open(
    world: World, api: Api, storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = api("alice")
    data = os.urandom(2500)
    created = open_upload(client, data)
    _put_last_first(client, created["id"], data, 1000)
    with monkeypatch.context() as full:
        full.setattr(os, "copy_file_range", _refuse(errno.ENOSPC))
        response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 507
    assert error_of(response)["code"] == "insufficient_storage"
    # Nothing stored, no temporary file left; the parts are kept and the upload is open.
    assert not Blob.objects.filter(sha256=sha256(data)).exists()
    assert not list((storage.parent / "tmp").glob("*"))
    assert Upload.objects.get(pk=created["id"]).status == UploadStatus.OPEN
    assert UploadPart.objects.filter(upload_id=created["id"]).count() == 3
    # Space is back: the same completion succeeds with the parts already sent.
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    assert (storage / Blob.address(sha256(data))).read_bytes() == data
    assert not any(name.startswith("staging/") for name in stored_files(storage))


@pytest.fixture
def hashed_at_completion(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of bytes completion hashes itself (after the parts' chain of states)."""
    counted: list[int] = []
    original = blobs.Whole.__call__

    def count(whole: Any, data: bytes | memoryview) -> None:
        counted.append(len(data))
        original(whole, data)

    monkeypatch.setattr(blobs.Whole, "__call__", count)
    return counted


def _put(client: APIClient, upload_id: str, number: int, chunk: bytes) -> None:
    response = client.put(
        f"/api/v1/uploads/{upload_id}/parts/{number}/",
        data=chunk,
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(chunk),
    )
    assert response.status_code == 200, response.content


def _complete(client: APIClient, upload_id: str, data: bytes, storage: Path) -> None:
    response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    assert response.status_code == 200, response.content
    assert (storage / Blob.address(sha256(data))).read_bytes() == data


def test_parts_sent_in_order_are_hashed_once(
    world: World, api: Api, storage: Path, hashed_at_completion: list[int]
) -> None:
    client = api("alice")
    data = os.urandom(3 * 1000 + 7)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    _complete(client, created["id"], data, storage)
    assert sum(hashed_at_completion) == 0


def test_completion_hashes_what_came_out_of_order(
    world: World, api: Api, storage: Path, hashed_at_completion: list[int]
) -> None:
    client = api("alice")
    data = os.urandom(3500)
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    created = open_upload(client, data)
    # Part 4 overtakes part 3: the chain runs 1, 2 and 3; part 4 is hashed at the end.
    for number in (1, 2, 4, 3):
        _put(client, created["id"], number, chunks[number - 1])
    _complete(client, created["id"], data, storage)
    assert sum(hashed_at_completion) == len(chunks[3])


def test_a_part_replaced_after_its_successor_ends_the_chain(
    world: World, api: Api, storage: Path, hashed_at_completion: list[int]
) -> None:
    client = api("alice")
    data = os.urandom(3000)
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    created = open_upload(client, data)
    _put(client, created["id"], 1, chunks[0])
    _put(client, created["id"], 2, os.urandom(1000))  # damaged in the client, then sent again
    _put(client, created["id"], 3, chunks[2])  # hashed on from the damaged part 2
    _put(client, created["id"], 2, chunks[1])
    _complete(client, created["id"], data, storage)
    # Part 3's state was taken from bytes that are no longer part 2: it is hashed again.
    assert sum(hashed_at_completion) == len(chunks[2])


def test_without_a_resumable_hash_completion_hashes_every_part(
    world: World,
    api: Api,
    storage: Path,
    hashed_at_completion: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sha256state, "available", lambda: False)
    client = api("alice")
    data = os.urandom(2500)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    _complete(client, created["id"], data, storage)
    assert sum(hashed_at_completion) == len(data)
    assert not UploadPart.objects.exclude(chain=None).exists()


def test_parts_sent_in_order_lie_in_one_file_that_becomes_the_blob(
    world: World, api: Api, storage: Path, hashed_at_completion: list[int]
) -> None:
    client = api("alice")
    data = os.urandom(2 * 1000 + 500)
    created = open_upload(client, data)
    put_parts(client, created["id"], data, 1000)
    upload = Upload.objects.get(pk=created["id"])
    parts = list(UploadPart.objects.filter(upload=upload).order_by("number"))
    assert {part.storage_name for part in parts} == {disk.data_name(upload)}
    assert [part.offset for part in parts] == [0, 1000, 2000]
    staged = storage / disk.data_name(upload)
    assert staged.read_bytes() == data
    inode = staged.stat().st_ino
    _complete(client, created["id"], data, storage)
    # Completion renamed the data file into place: no byte copied or hashed again.
    assert (storage / Blob.address(sha256(data))).stat().st_ino == inode
    assert sum(hashed_at_completion) == 0
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_a_refused_part_takes_back_what_it_wrote(world: World, api: Api, storage: Path) -> None:
    client = api("alice")
    data = os.urandom(3000)
    created = open_upload(client, data)
    _put(client, created["id"], 1, data[:1000])
    refused = client.put(
        f"/api/v1/uploads/{created['id']}/parts/2/",
        data=data[1000:2000],
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(b"other bytes"),
    )
    assert error_of(refused)["code"] == "part_digest_mismatch"
    upload = Upload.objects.get(pk=created["id"])
    assert (storage / disk.data_name(upload)).read_bytes() == data[:1000]
    # The part sent again goes where the refused one was.
    _put(client, created["id"], 2, data[1000:2000])
    _put(client, created["id"], 3, data[2000:])
    assert UploadPart.objects.get(upload=upload, number=2).offset == 1000
    _complete(client, created["id"], data, storage)


def test_a_stored_part_sent_again_never_writes_over_its_bytes(
    world: World, api: Api, storage: Path
) -> None:
    client = api("alice")
    data = os.urandom(2000)
    created = open_upload(client, data)
    _put(client, created["id"], 1, os.urandom(1000))  # the wrong bytes, stored
    _put(client, created["id"], 2, data[1000:])
    upload = Upload.objects.get(pk=created["id"])
    in_place = (storage / disk.data_name(upload)).read_bytes()
    _put(client, created["id"], 1, data[:1000])  # sent again: a file of its own
    assert (storage / disk.data_name(upload)).read_bytes() == in_place
    first = UploadPart.objects.get(upload=upload, number=1)
    assert first.offset is None and first.storage_name != disk.data_name(upload)
    _complete(client, created["id"], data, storage)
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def _abort_between_reading_and_opening(
    client: APIClient, upload_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next claim reads the rows, then the upload is aborted, then the claim opens
    the data file (the interleaving CI once hit with real threads)."""
    real = disk._offset

    def then_abort(upload: Upload, number: int) -> int | None:
        offset = real(upload, number)
        monkeypatch.setattr(disk, "_offset", real)
        assert client.post(f"/api/v1/uploads/{upload_id}/abort/").status_code == 200
        return offset

    monkeypatch.setattr(disk, "_offset", then_abort)


def _first_part_in_place(client: APIClient) -> tuple[str, bytes]:
    """An open upload of 3000 bytes whose first part lies in its data file."""
    data = os.urandom(3000)
    created = open_upload(client, data)
    _put(client, created["id"], 1, data[:1000])
    return created["id"], data


def test_a_claim_that_loses_its_race_with_an_abort_creates_no_file(
    world: World, api: Api, storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = api("alice")
    upload_id, _ = _first_part_in_place(client)
    upload = Upload.objects.get(pk=upload_id)
    _abort_between_reading_and_opening(client, upload_id, monkeypatch)
    assert disk.claim(upload, 2, 1000) is None
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_a_part_refused_by_an_abort_during_its_claim_leaves_nothing_staged(
    world: World, api: Api, storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = api("alice")
    upload_id, data = _first_part_in_place(client)
    _abort_between_reading_and_opening(client, upload_id, monkeypatch)
    refused = client.put(
        f"/api/v1/uploads/{upload_id}/parts/2/",
        data=data[1000:2000],
        content_type="application/octet-stream",
        HTTP_X_PART_SHA256=sha256(data[1000:2000]),
    )
    assert refused.status_code == 409, refused.content
    assert error_of(refused)["detail"]["status"] == "aborted"
    assert Upload.objects.get(pk=upload_id).status == UploadStatus.ABORTED
    assert not any(name.startswith("staging/") for name in stored_files(storage))


def test_one_range_is_written_by_one_request_at_a_time(world: World, api: Api) -> None:
    client = api("alice")
    created = open_upload(client, os.urandom(2000))
    upload = Upload.objects.get(pk=created["id"])
    first = disk.claim(upload, 1, 1000)
    assert first is not None
    try:
        # Another request for the same part (its retry) writes a file of its own.
        assert disk.claim(upload, 1, 1000) is None
        assert disk.claim(upload, 1, 10) is None
        # Part 2 goes in place only after part 1 is stored.
        assert disk.claim(upload, 2, 1000) is None
    finally:
        first.abandon()
        first.close()
    second = disk.claim(upload, 1, 1000)
    assert second is not None
    second.abandon()
    second.close()
