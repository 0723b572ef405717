"""Completion on local disk: the kernel joins the parts while the platform hashes them."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.uploads import services, sha256state
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World, error_of, open_upload, put_parts, sha256, stored_files

Api = Callable[[str | None], APIClient]


def _refuse(code: int) -> Callable[..., int]:
    def copy_file_range(*args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code))

    return copy_file_range


def test_parts_are_joined_where_copy_file_range_is_missing(
    world: World, api: Api, storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.ENOSYS))
    data = os.urandom(3500)
    created = open_upload(api("alice"), data)
    put_parts(api("alice"), created["id"], data, 1000)
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
    put_parts(client, created["id"], data, 1000)
    with monkeypatch.context() as full:
        full.setattr(os, "copy_file_range", _refuse(errno.ENOSPC))
        response = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert response.status_code == 507
    assert error_of(response)["code"] == "insufficient_storage"
    # Nothing stored, no temporary file left; the parts are kept and the upload is open.
    assert not Blob.objects.filter(sha256=sha256(data)).exists()
    assert not list((storage.parent / "tmp").iterdir())
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
    original = services._Whole.__call__

    def count(whole: Any, data: bytes | memoryview) -> None:
        counted.append(len(data))
        original(whole, data)

    monkeypatch.setattr(services._Whole, "__call__", count)
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
