"""Upload state transitions racing each other, over HTTP against a real server.

Security round 2 (issue 34, findings 2, 3 and 6). Each test starts two or more
transitions of one upload at the same instant (threads released by a barrier) against
Django's live test server (a thread per request, each with its own PostgreSQL
connection), many rounds over, and checks after every round:

* no 5xx, and only the statuses the pair allows (200, 409, and the codes named);
* the upload is in one consistent state: ``complete`` with its blob stored whole and no
  part left, ``aborted`` or ``failed`` with no part and no staged file, or ``open`` with
  exactly the staged files its part rows name, each hashing to its row;
* ``received_bytes`` never exceeds the declared size, no reservation and no temporary
  file is left behind.

The expiry side runs the Celery task's body (``expire_uploads``) in a thread of this
process. With SQLite the server serialises every transaction and the races do not
happen, so these tests are for PostgreSQL (``services``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from attestations.accounts.models import ApiKey
from attestations.uploads import disk
from attestations.uploads import services as uploads
from attestations.uploads.models import Blob, PartReservation, Upload, UploadPart, UploadStatus
from attestations.uploads.parts import put_part
from attestations.uploads.tasks import expire_uploads
from tests.attestations.base import World, part_bytes, sha256, stored_files
from tests.conftest import SERVICES_SKIP_REASON, services_configured

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not services_configured(), reason=SERVICES_SKIP_REASON),
]

#: Rounds per pair; each round is a fresh upload. The report saw 2 failures in 14 tries.
ROUNDS = int(os.environ.get("DVBENCH_RACE_ROUNDS", "12"))
PART = 8 * 1024
PARTS = 8
TIMEOUT = 30.0


@dataclass
class Server:
    url: str
    headers: dict[str, str]
    media: Path

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(
            method,
            f"{self.url}/api/v1/{path}",
            headers={**self.headers, **kwargs.pop("headers", {})},
            timeout=TIMEOUT,
            **kwargs,
        )

    def put_part(self, upload: Upload, number: int, data: bytes) -> requests.Response:
        return self.call(
            "PUT",
            f"uploads/{upload.pk}/parts/{number}/",
            data=data,
            headers={"Content-Type": "application/octet-stream", "X-Part-SHA256": sha256(data)},
        )

    def complete(self, upload: Upload) -> requests.Response:
        return self.call("POST", f"uploads/{upload.pk}/complete/")

    def abort(self, upload: Upload) -> requests.Response:
        return self.call("POST", f"uploads/{upload.pk}/abort/")


@pytest.fixture
def server(world: World, live_server: Any, storage: Path, settings: Any) -> Iterator[Server]:
    # Hundreds of upload requests a minute: the per-user limit is not what is tested.
    settings.DVBENCH_RATE_LIMITS = {**settings.DVBENCH_RATE_LIMITS, "uploads": None}
    _, key = ApiKey.issue(world.alice, "races")
    # Hundreds of expected 409s would each log a warning; a 500 still logs an error.
    logger = logging.getLogger("django.request")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield Server(str(live_server.url), {"Authorization": f"Bearer {key}"}, storage)
    finally:
        logger.setLevel(level)


def race(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` in threads released together; their results (or exceptions), in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[index] = call()
        except BaseException as error:  # noqa: BLE001 - raised again by the caller
            results[index] = error
        finally:
            connection.close()  # a thread's own database connection (the expiry task)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT * 2)
        assert not thread.is_alive(), "a racing request never returned"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def open_upload(world: World, data: bytes, *, parts: int = 0) -> Upload:
    """An open upload of ``data`` with its first ``parts`` parts already received."""
    upload = uploads.create(
        experiment=world.experiment,
        kind="artifact",
        size=len(data),
        sha256=sha256(data),
        user=world.alice,
    )
    for number in range(1, parts + 1):
        chunk = data[(number - 1) * PART : number * PART]
        put_part(
            upload,
            number,
            stream=io.BytesIO(chunk),
            declared_sha256=sha256(chunk),
            content_length=len(chunk),
        )
    return upload


def status_of(response: requests.Response, allowed: dict[int, set[str] | None]) -> int:
    """The response's status, checked against ``allowed`` (status: error codes, or None)."""
    status = response.status_code
    assert status in allowed, f"{status} not in {sorted(allowed)}: {response.text[:500]}"
    codes = allowed[status]
    if codes is not None:
        error = response.json()["error"]
        assert error["code"] in codes, error
        assert error["message"], error
    return status


def staged(media: Path, upload: Upload) -> set[str]:
    """The staged files of ``upload``, by storage name."""
    prefix = upload.staging_prefix + "/"
    return {name for name in stored_files(media) if name.startswith(prefix)}


def check_consistent(server: Server, upload: Upload, data: bytes | None = None) -> str:
    """Assert ``upload`` is in one consistent state; returns the state."""
    upload = Upload.objects.get(pk=upload.pk)
    rows = list(UploadPart.objects.filter(upload=upload))
    files = staged(server.media, upload)
    received = sum(p.size for p in rows)
    assert received <= upload.size, f"received {received} > declared {upload.size}"
    assert not PartReservation.objects.filter(upload=upload).exists(), "a reservation leaked"
    tmp = Path(str(django_settings.DVBENCH["DATA_DIR"])) / "tmp"
    assert not list(tmp.glob("*")), f"temporary files left: {list(tmp.glob('*'))}"
    if upload.status == UploadStatus.OPEN:
        named = {p.storage_name for p in rows}
        # The files the rows name, and at most the data file beside them (its in-place
        # parts all sent again as files of their own); each part's bytes hash to its row.
        assert named <= files, f"rows name {sorted(named - files)}, not staged"
        assert files - named <= {disk.data_name(upload)}, f"staged {sorted(files - named)}"
        for part in rows:
            digest = hashlib.sha256(part_bytes(server.media, part)).hexdigest()
            assert digest == part.sha256, f"part {part.number} does not hash to its row"
        assert len({p.number for p in rows}) == len(rows)
    else:
        assert upload.status in (UploadStatus.COMPLETE, UploadStatus.ABORTED, UploadStatus.FAILED)
        assert not rows, f"{upload.status} upload keeps part rows"
        assert not files, f"{upload.status} upload keeps staged files {sorted(files)}"
    if upload.status == UploadStatus.COMPLETE:
        assert upload.blob is not None
        stored = (server.media / upload.blob.storage_name).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == upload.sha256
        if data is not None:
            assert stored == data
    else:
        assert upload.blob is None
        if data is not None:
            assert not Blob.objects.filter(sha256=sha256(data)).exists()
    return str(upload.status)


NOT_OPEN = {"upload_not_open"}


def test_complete_racing_abort(world: World, server: Server) -> None:
    """The report's 500: an 8-part upload completed and aborted at once (2 in 14 tries)."""
    outcomes: set[str] = set()
    for _ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS)
        done, aborted = race(partial(server.complete, upload), partial(server.abort, upload))
        done_status = status_of(done, {200: None, 409: NOT_OPEN})
        abort_status = status_of(aborted, {200: None, 409: NOT_OPEN})
        state = check_consistent(server, upload, data)
        # Exactly one wins, and the state is the winner's.
        assert sorted([done_status, abort_status]) == [200, 409]
        assert state == ("complete" if done_status == 200 else "aborted")
        assert (done if done_status == 200 else aborted).json()["status"] == state
        outcomes.add(state)
    # Not asserted (scheduling decides), but said: both orders are normally seen.
    print(f"complete/abort outcomes over {ROUNDS} rounds: {sorted(outcomes)}")


def test_complete_racing_complete(world: World, server: Server) -> None:
    for _ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS)
        responses = race(*[partial(server.complete, upload)] * 4)
        statuses = [status_of(r, {200: None, 409: NOT_OPEN}) for r in responses]
        assert 200 in statuses
        for response in responses:
            if response.status_code == 200:
                assert response.json()["status"] == "complete"
            else:  # another request was assembling it: the SDK waits and asks again
                assert response.json()["error"]["detail"] == {"status": "completing"}
        assert check_consistent(server, upload, data) == "complete"
        assert server.complete(upload).json()["status"] == "complete"


def test_complete_racing_expiry(world: World, server: Server) -> None:
    for _ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS)
        Upload.objects.filter(pk=upload.pk).update(expires=timezone.now())
        done, expired = race(partial(server.complete, upload), expire_uploads)
        done_status = status_of(done, {200: None, 409: NOT_OPEN})
        state = check_consistent(server, upload, data)
        if done_status == 200:
            assert (state, expired) == ("complete", 0)
        else:
            assert (state, expired) == ("aborted", 1)
            assert Upload.objects.get(pk=upload.pk).reason == "expired"


def test_complete_racing_a_part_retry(world: World, server: Server) -> None:
    """A part sent again while completion assembles the parts: the parts stay whole."""
    for round_ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS)
        number = round_ % PARTS + 1
        chunk = data[(number - 1) * PART : number * PART]
        done, put = race(
            partial(server.complete, upload), partial(server.put_part, upload, number, chunk)
        )
        assert status_of(done, {200: None}) == 200
        status_of(put, {200: None, 409: NOT_OPEN})
        assert check_consistent(server, upload, data) == "complete"


def test_abort_racing_parts(world: World, server: Server) -> None:
    for round_ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS - 2)
        numbers = (PARTS - 1, PARTS, round_ % (PARTS - 2) + 1)  # two new, one sent again
        chunks = {n: data[(n - 1) * PART : n * PART] for n in numbers}
        aborted, *puts = race(
            partial(server.abort, upload),
            *[partial(server.put_part, upload, n, c) for n, c in chunks.items()],
        )
        assert status_of(aborted, {200: None}) == 200
        for put in puts:
            # A part sent again counts twice until it lands (its old copy is still
            # staged), so beside two new parts it can fill the declared size: 409.
            status_of(put, {200: None, 409: NOT_OPEN | {"size_exceeded"}})
        assert check_consistent(server, upload, data) == "aborted"


def test_expiry_racing_parts_and_abort(world: World, server: Server) -> None:
    for _ in range(ROUNDS):
        data = os.urandom(PART * PARTS)
        upload = open_upload(world, data, parts=PARTS - 1)
        Upload.objects.filter(pk=upload.pk).update(expires=timezone.now())
        chunk = data[(PARTS - 1) * PART :]
        expired, aborted, put = race(
            expire_uploads,
            partial(server.abort, upload),
            partial(server.put_part, upload, PARTS, chunk),
        )
        assert status_of(aborted, {200: None}) == 200  # aborting an expired upload is harmless
        status_of(put, {200: None, 409: NOT_OPEN})
        assert check_consistent(server, upload, data) == "aborted"
        reason = Upload.objects.get(pk=upload.pk).reason
        assert (expired, reason) in ((1, "expired"), (0, "aborted"))


def test_parallel_parts_never_exceed_the_declared_size(world: World, server: Server) -> None:
    """The report: 2,000 bytes declared, eight 1,000-byte parts at once; 3,000 received."""
    for _ in range(ROUNDS):
        data = os.urandom(2000)
        upload = open_upload(world, data)
        chunks = {n: os.urandom(1000) for n in range(1, 9)}
        responses = race(*[partial(server.put_part, upload, n, c) for n, c in chunks.items()])
        statuses = [status_of(r, {200: None, 409: {"size_exceeded"}}) for r in responses]
        # The bytes are reserved before the body is read: the first two claims win.
        assert statuses.count(200) == 2, statuses
        for response in responses:
            if response.status_code == 409:
                detail = response.json()["error"]["detail"]
                assert detail["expected"] == 2000 and detail["got"] > 2000, detail
        assert check_consistent(server, upload) == "open"
        upload.refresh_from_db()
        assert upload.received_bytes == 2000


def test_the_same_part_sent_in_parallel_keeps_one_copy(world: World, server: Server) -> None:
    for _ in range(ROUNDS):
        data = os.urandom(2 * PART)
        upload = open_upload(world, data, parts=1)
        versions = [os.urandom(PART) for _ in range(6)]
        responses = race(*[partial(server.put_part, upload, 2, c) for c in versions])
        statuses = [status_of(r, {200: None, 409: {"size_exceeded"}}) for r in responses]
        assert 200 in statuses
        assert check_consistent(server, upload) == "open"
        part = UploadPart.objects.get(upload=upload, number=2)
        won = {r.json()["sha256"] for r in responses if r.status_code == 200}
        assert part.sha256 in won
        assert UploadPart.objects.filter(upload=upload).count() == 2


# --- A body shorter than its Content-Length (finding 6) --------------------------------------


def send_short(
    url: str, path: str, headers: dict[str, str], body: bytes, declared: int, method: str = "PUT"
) -> tuple[int, Any]:
    """Promise ``declared`` bytes, send ``body`` (fewer), close the write side.

    Returns the reply's status and its body as JSON.
    """
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT) as conn:
        head = [
            f"{method} {path} HTTP/1.1",
            f"Host: {parts.hostname}",
            f"Content-Length: {declared}",
        ]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append("Connection: close")
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head_bytes, _, content = reply.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ")[1]), json.loads(content)


def test_a_part_shorter_than_its_content_length_is_a_400(world: World, server: Server) -> None:
    """The report: Content-Length 2000, 1,000 bytes sent and the write side closed: 200."""
    data = os.urandom(2000)
    upload = open_upload(world, data)
    sent = data[:1000]
    status, reply = send_short(
        server.url,
        f"/api/v1/uploads/{upload.pk}/parts/1/",
        {
            **server.headers,
            "Content-Type": "application/octet-stream",
            "X-Part-SHA256": sha256(sent),
        },
        sent,
        2000,
    )
    assert status == 400, reply
    error = reply["error"]
    assert error["code"] == "incomplete_body"
    assert error["field"] == "body"
    assert error["detail"] == {"expected": 2000, "got": 1000}
    assert "Content-Length is 2000 bytes but the body ended after 1000" in error["message"]
    # Nothing kept: no part, no staged or temporary file, no reservation; the part sent
    # whole afterwards is accepted.
    assert check_consistent(server, upload) == "open"
    assert not UploadPart.objects.filter(upload=upload).exists()
    assert server.put_part(upload, 1, data[:1000]).status_code == 200
    assert server.put_part(upload, 2, data[1000:]).status_code == 200
    assert server.complete(upload).json()["status"] == "complete"


def test_an_upload_declaration_shorter_than_its_content_length_is_a_400(
    world: World, server: Server
) -> None:
    """A whole JSON object, without the padding its Content-Length promised: not opened."""
    data = os.urandom(2000)
    body = json.dumps(
        {"experiment": "acme/run-1", "kind": "artifact", "size": 2000, "sha256": sha256(data)}
    ).encode()
    before = Upload.objects.count()
    status, reply = send_short(
        server.url,
        "/api/v1/uploads/",
        {**server.headers, "Content-Type": "application/json"},
        body,
        len(body) + 100,
        method="POST",
    )
    assert status == 400, reply
    assert reply["error"]["code"] == "incomplete_body"
    assert reply["error"]["field"] == "body"
    assert Upload.objects.count() == before
    # The same declaration sent whole opens the upload.
    assert (
        server.call(
            "POST", "uploads/", data=body, headers={"Content-Type": "application/json"}
        ).status_code
        == 201
    )
