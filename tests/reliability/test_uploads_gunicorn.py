"""Uploads through the real gunicorn, where a part's body is received straight into the
worker's buffers (``attestations/http/body.py``), not through Django's stream.

The server runs ``platform/gunicorn.conf.py`` in a subprocess on the PostgreSQL test
database; the test speaks raw HTTP so it can send a body that ends early, lies about
its length or is followed by the client's next request.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings as django_settings

from attestations.accounts.models import ApiKey
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus
from tests.attestations.base import World
from tests.conftest import SERVICES_SKIP_REASON, services_configured
from tests.reliability.stack import gunicorn

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.services,
    pytest.mark.skipif(not services_configured(), reason=SERVICES_SKIP_REASON),
]

PART = 3 * 1024 * 1024 + 17  # more than one receive, not a multiple of a buffer


@pytest.fixture
def platform(world: World, tmp_path: Path) -> Iterator[tuple[int, str, Path]]:
    """gunicorn on the test database; its port, an API key of alice's and its data dir."""
    _, key = ApiKey.issue(world.alice, "gunicorn")
    parts = urlsplit(os.environ["DATABASE_URL"])
    database = urlunsplit(parts._replace(path=f"/{django_settings.DATABASES['default']['NAME']}"))
    data = tmp_path / "served"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DVBENCH_", "DJANGO_"))}
    environment.update(
        DATABASE_URL=database,
        DVBENCH_DATA_DIR=str(data),
        DJANGO_SETTINGS_MODULE="config.settings",
    )
    with gunicorn(environment, tmp_path / "gunicorn.log") as port:
        yield port, key, data


def _exchange(port: int, request: bytes, *, hang_up: bool = False) -> tuple[int, dict[str, Any]]:
    """Send ``request`` whole (closing the sending side after it with ``hang_up``);
    the status and the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(request)
        if hang_up:
            connection.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _part(key: str, upload: str, number: int, data: bytes, *, length: int | None = None) -> bytes:
    head = (
        f"PUT /api/v1/uploads/{upload}/parts/{number}/ HTTP/1.1\r\n"
        "Host: localhost\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Content-Length: {len(data) if length is None else length}\r\n"
        f"X-Part-SHA256: {hashlib.sha256(data).hexdigest()}\r\n\r\n"
    )
    return head.encode() + data


def _post(key: str, path: str, document: dict[str, Any] | None = None) -> bytes:
    body = json.dumps(document or {}).encode()
    head = (
        f"POST /api/v1/{path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_a_multipart_upload_through_gunicorn_stores_every_byte(
    platform: tuple[int, str, Path],
) -> None:
    port, key, data_dir = platform
    chunks = [os.urandom(PART), os.urandom(PART), os.urandom(1000)]
    whole = b"".join(chunks)
    status, created = _exchange(
        port,
        _post(
            key,
            "uploads/",
            {
                "experiment": "acme/run-1",
                "kind": "artifact",
                "size": len(whole),
                "sha256": hashlib.sha256(whole).hexdigest(),
            },
        ),
    )
    assert status == 201, created
    upload = created["id"]

    # A body that ends before its Content-Length: refused, nothing of it kept.
    cut = PART // 2
    status, answer = _exchange(port, _part(key, upload, 1, chunks[0])[:-cut], hang_up=True)
    assert status == 400 and answer["error"]["code"] == "incomplete_body", answer
    assert answer["error"]["detail"] == {"expected": PART, "got": PART - cut}
    assert not UploadPart.objects.filter(upload_id=upload).exists()

    # A part whose bytes are not the digest it declares: refused, and sent again.
    forged = _part(key, upload, 2, chunks[1])
    forged = forged[:-1] + bytes([forged[-1] ^ 1])
    status, answer = _exchange(port, forged)
    assert status == 400 and answer["error"]["code"] == "part_digest_mismatch", answer

    # Part 1, then part 3 with the client's next request already behind its body on
    # the connection (gunicorn closes after each answer; the bytes must not leak into
    # the part), then part 2.
    for number, request in (
        (1, _part(key, upload, 1, chunks[0])),
        (3, _part(key, upload, 3, chunks[2]) + _post(key, f"uploads/{upload}/abort/")),
        (2, _part(key, upload, 2, chunks[1])),
    ):
        status, answer = _exchange(port, request)
        assert status == 200, answer
        assert answer["sha256"] == hashlib.sha256(chunks[number - 1]).hexdigest()

    status, answer = _exchange(port, _post(key, f"uploads/{upload}/complete/"))
    assert status == 200, answer
    stored = Upload.objects.get(pk=upload)
    assert stored.status == UploadStatus.COMPLETE
    blob = Blob.objects.get(sha256=hashlib.sha256(whole).hexdigest())
    assert (data_dir / "media" / blob.storage_name).read_bytes() == whole
