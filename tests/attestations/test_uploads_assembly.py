"""Completion on local disk: the kernel joins the parts while the platform hashes them."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

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
