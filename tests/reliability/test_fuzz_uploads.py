"""Hostile requests to every upload endpoint: a clear 4xx in the one error format, never a 500.

The endpoints (create, part, complete, abort) get hostile JSON and raw bodies (invalid
UTF-8, wrong types, path-like names and experiment names, oversized bodies), hostile
headers (digests that are wrong, malformed or not ASCII, Content-Length lies), hostile
ids and part numbers. After every example the storage holds only what it may: blobs under
their content address that hash to it, and staged parts a row names; nothing else, and the
stored blob of the world is untouched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from hypothesis import assume, given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from attestations.uploads import disk
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World, error_of, part_bytes, sha256, stored_files
from tests.reliability.fuzz import budget

Api = Callable[[str | None], APIClient]

HEX = "0123456789abcdef"
path_like = st.sampled_from(
    [
        "../../etc/passwd",
        "..\\..\\windows\\win.ini",
        "/etc/shadow",
        "acme/../evil/heist",
        "acme/run-1/../../x",
        "%2e%2e%2fetc",
        "acme/run-1\x00.txt",
        "C:\\boot.ini",
        "~/.ssh/id_rsa",
        "blobs/sha256/ab/cd/" + "ab" * 32,
        "staging/uploads/x",
        "a" * 5000,
    ]
)
text = st.one_of(st.text(max_size=40), path_like)
json_value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
digest = st.one_of(
    st.text(HEX, min_size=64, max_size=64),
    st.text(HEX.upper(), min_size=64, max_size=64),
    st.text(max_size=80),
    path_like,
)


def create_body() -> st.SearchStrategy[Any]:
    """Upload declarations: mostly well-formed, with one or more fields hostile."""
    field = {
        "experiment": st.one_of(st.just("acme/run-1"), st.just("evil/heist"), text, json_value),
        "kind": st.one_of(st.sampled_from(["transcript", "artifact", "snapshot"]), text),
        "size": st.one_of(st.integers(min_value=-(2**70), max_value=2**70), json_value),
        "sha256": st.one_of(digest, json_value),
        "name": st.one_of(path_like, text, json_value),
    }
    return st.one_of(
        st.fixed_dictionaries({}, optional=field),
        st.fixed_dictionaries(field),
        json_value,
    )


@pytest.fixture(autouse=True)
def _no_rate_limits(settings: Any) -> None:
    """A long fuzzing run sends more uploads a minute than the limit allows."""
    settings.DVBENCH_RATE_LIMITS = dict.fromkeys(settings.DVBENCH_RATE_LIMITS)


def clear_rejection(response: Any, *allowed: int) -> None:
    """Not a 5xx; a 4xx carries the one error format with a message."""
    assert response.status_code < 500, (response.status_code, response.content[:500])
    if allowed:
        assert response.status_code in allowed, (response.status_code, response.content[:500])
    if response.status_code >= 400:
        error = error_of(response)
        assert error["code"] and error["message"], error


def check_storage(media: Path, world: World) -> None:
    """Only content-addressed blobs with rows, and staged parts with rows, are stored."""
    staged = set(UploadPart.objects.values_list("storage_name", flat=True))
    # An open upload's data file may outlive the in-place parts sent again as files.
    staged |= {disk.data_name(u) for u in Upload.objects.filter(status=UploadStatus.OPEN)}
    blobs = {b.storage_name: b.sha256 for b in Blob.objects.all()}
    for name in stored_files(media):
        if name in staged:
            continue
        assert name in blobs, f"unexpected stored file {name}"
        assert hashlib.sha256((media / name).read_bytes()).hexdigest() == blobs[name], name
    assert (media / world.proof.transcript.storage_name).read_bytes() == b"not really a transcript"
    leftovers = [p for p in (Path(django_settings.DVBENCH["DATA_DIR"]) / "tmp").glob("*")]
    assert not leftovers, leftovers


@budget(2)
@given(body=create_body())
def test_create_rejects_hostile_declarations_clearly(
    world: World, api: Api, storage: Path, body: Any
) -> None:
    response = api("alice").post("/api/v1/uploads/", body, format="json")
    clear_rejection(response, 201, 400, 403, 404, 409, 413, 422)
    check_storage(storage, world)


@budget(1)
@given(
    raw=st.one_of(
        st.binary(max_size=200),
        st.builds(lambda b: b'{"experiment": "' + b + b'"}', st.binary(max_size=20)),
    ),
    content_type=st.sampled_from(
        [
            "application/json",
            "application/json; charset=latin-1",
            "text/plain",
            "",
            "multipart/form-data",
        ]
    ),
)
def test_create_rejects_bodies_that_are_not_json(
    world: World, api: Api, storage: Path, raw: bytes, content_type: str
) -> None:
    response = api("alice").generic("POST", "/api/v1/uploads/", raw, content_type=content_type)
    clear_rejection(response, 201, 400, 403, 415)


def test_create_body_over_the_memory_limit_is_413(
    world: World, api: Api, storage: Path, settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    body = json.dumps({"experiment": "acme/run-1", "name": "x" * 4096}).encode()
    response = api("alice").generic(
        "POST", "/api/v1/uploads/", body, content_type="application/json"
    )
    clear_rejection(response, 413)
    assert error_of(response)["code"] == "too_large"


@budget(3)
@given(
    target=st.sampled_from(["open", "random", "path"]),
    number=st.one_of(
        st.integers(min_value=0, max_value=20), st.integers(min_value=0, max_value=10**30)
    ),
    body=st.one_of(
        st.binary(max_size=64),
        st.just(b"hello"),
        st.builds(lambda n: b"\xff" * n, st.integers(64 * 1024 - 2, 64 * 1024 + 2)),
    ),
    header=st.one_of(st.none(), st.just("right"), digest, st.binary(max_size=70)),
    length=st.one_of(
        st.none(), st.sampled_from(["", "abc", "-5", "0", "1", "99999999999999999999", " 5", "5 "])
    ),
)
def test_part_rejects_hostile_requests_clearly(
    world: World,
    api: Api,
    storage: Path,
    target: str,
    number: int,
    body: bytes,
    header: str | bytes | None,
    length: str | None,
) -> None:
    upload_id = {
        "open": str(world.upload.id),
        "random": "00000000-0000-4000-8000-000000000000",
        "path": "..%2f..%2fetc%2fpasswd",
    }[target]
    extra: dict[str, str] = {}
    if header == "right":
        extra["HTTP_X_PART_SHA256"] = sha256(body)
    elif isinstance(header, bytes):
        # A WSGI server hands header bytes to Django decoded as latin-1.
        extra["HTTP_X_PART_SHA256"] = header.decode("latin-1")
    elif header is not None:
        extra["HTTP_X_PART_SHA256"] = header
    if length is not None:
        declared = length.strip()
        # Django's test client cannot send less body than Content-Length promises (it
        # asserts); a real server reading a short body is in test_faults.py.
        assume(not (declared.isdigit() and len(body) < int(declared) <= 64 * 1024))
        extra["CONTENT_LENGTH"] = length
    response = api("alice").generic(
        "PUT",
        f"/api/v1/uploads/{upload_id}/parts/{number}/",
        body,
        content_type="application/octet-stream",
        **extra,
    )
    clear_rejection(response, 200, 400, 404, 409, 411, 413)
    if response.status_code == 200:
        # Only a part whose bytes match its declared digest is ever accepted.
        part = UploadPart.objects.get(upload=world.upload, number=number)
        stored = part_bytes(storage, part)  # its own file, or its range
        assert stored == body[: part.size]
        assert part.sha256 == sha256(stored)
    check_storage(storage, world)


@budget(1)
@given(
    action=st.sampled_from(["complete", "abort", "get"]),
    upload_id=st.one_of(
        st.just("open"),
        st.uuids().map(str),
        st.text("0123456789abcdef-", min_size=36, max_size=36),
    ),
)
def test_complete_and_abort_reject_hostile_ids_clearly(
    world: World, api: Api, storage: Path, action: str, upload_id: str
) -> None:
    if upload_id == "open":
        upload_id = str(world.upload.id)
    client = api("alice")
    if action == "complete":
        response = client.post(f"/api/v1/uploads/{upload_id}/complete/")
    elif action == "abort":
        response = client.post(f"/api/v1/uploads/{upload_id}/abort/")
    else:
        response = client.get(f"/api/v1/uploads/{upload_id}/")
    clear_rejection(response, 200, 400, 404, 409)
    check_storage(storage, world)


@pytest.mark.parametrize("actor", ["bob", "carol", "mallory", None])
def test_other_roles_and_outsiders_are_refused_in_the_error_format(
    world: World, api: Api, storage: Path, actor: str | None
) -> None:
    upload = f"/api/v1/uploads/{world.upload.id}"
    client = api(actor)
    for response in (
        client.post(
            "/api/v1/uploads/",
            {"experiment": "acme/run-1", "kind": "artifact", "size": 5, "sha256": sha256(b"hello")},
            format="json",
        ),
        client.generic(
            "PUT",
            f"{upload}/parts/1/",
            b"hello",
            content_type="application/octet-stream",
            HTTP_X_PART_SHA256=sha256(b"hello"),
        ),
        client.post(f"{upload}/complete/"),
        client.post(f"{upload}/abort/"),
    ):
        clear_rejection(response, 400, 401, 403, 404)
    check_storage(storage, world)
