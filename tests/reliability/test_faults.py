"""Faults: servers restarted, workers killed, the disk full, clients gone mid-request.

After each fault every ingest job completes exactly once (one verdict, one audit event,
its job succeeded), no partial artifact is visible, and stored data is untouched.

The broker and database faults run on a private stack (``stack.py``: PostgreSQL and Redis
started by the test on their own ports) and are marked ``services`` and ``slow``; they
skip where the servers' binaries are missing. The disk-full test needs root (it mounts a
small tmpfs); the disconnect test runs against a real HTTP server (pytest-django's
``live_server``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from django.conf import settings as django_settings
from rest_framework.test import APIClient

from attestations.uploads.models import Upload, UploadPart
from tests.attestations.base import World, error_of, open_upload, sha256, stored_files
from tests.conftest import services_configured
from tests.reliability import stack as private

Api = Callable[[str | None], APIClient]
SETTLE_SECONDS = 120.0


# --- A private stack ----------------------------------------------------------------------


@pytest.fixture
def stack() -> Iterator[private.Stack]:
    if not services_configured():
        pytest.skip("fault tests run with the services (set DATABASE_URL and REDIS_URL)")
    reason = private.available()
    if reason:
        pytest.skip(reason)
    # Not under pytest's temporary root (mode 700): the postgres user must reach it.
    work = Path(tempfile.mkdtemp(prefix="dvbench-faults-"))
    platform = private.Stack(work)
    try:
        platform.start()
        yield platform
    finally:
        platform.stop()
        shutil.rmtree(work, ignore_errors=True)


def outcome(platform: private.Stack) -> dict[int, dict[str, Any]]:
    """Per proof: status, verdict audit events, job statuses (read straight from SQL)."""
    with psycopg.connect(
        platform.pg.url.replace("postgres://", "postgresql://"), connect_timeout=5
    ) as db:
        proofs = db.execute("SELECT id, status FROM attestations_proof ORDER BY id").fetchall()
        result: dict[int, dict[str, Any]] = {}
        for pk, status in proofs:
            verdicts = db.execute(
                "SELECT count(*) FROM attestations_auditevent WHERE target_type = 'proof' "
                "AND target_id = %s AND action IN ('proof.valid', 'proof.rejected', 'proof.error')",
                (str(pk),),
            ).fetchone()
            jobs = db.execute(
                "SELECT status FROM attestations_job WHERE proof_id = %s ORDER BY id", (pk,)
            ).fetchall()
            result[pk] = {
                "status": status,
                "verdicts": verdicts[0] if verdicts else 0,
                "jobs": [j[0] for j in jobs],
            }
    return result


def settle(platform: private.Stack, ids: list[int]) -> dict[int, dict[str, Any]]:
    """Wait until every proof has a final verdict; then return the outcome."""
    deadline = time.monotonic() + SETTLE_SECONDS
    last: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        try:
            last = outcome(platform)
        except psycopg.OperationalError:
            last = {}
        if set(ids) <= set(last) and all(
            last[i]["status"] in ("valid", "rejected", "error") for i in ids
        ):
            time.sleep(2)  # let a duplicate delivery, if any, show itself
            return outcome(platform)
        time.sleep(1)
    raise AssertionError(
        f"proofs not final after {SETTLE_SECONDS:.0f} s: {last}\n{platform.worker_log()}"
    )


def assert_exactly_once(result: dict[int, dict[str, Any]], ids: list[int], log: str) -> None:
    for pk in ids:
        proof = result[pk]
        assert proof["status"] == "valid", (pk, proof, log[-3000:])
        assert proof["verdicts"] == 1, (pk, proof)
        assert proof["jobs"] == ["succeeded"], (pk, proof)


def file_proofs(platform: private.Stack, count: int, seed: int = 0) -> list[int]:
    ids = platform.python(private.FILE_PROOFS, str(count), str(seed))
    assert len(ids) == count
    return list(ids)


def wait_for_some_final(platform: private.Stack, ids: list[int], minimum: int) -> None:
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        done = [p for p in outcome(platform).values() if p["status"] in ("valid", "rejected")]
        if len(done) >= minimum:
            return
        time.sleep(0.2)
    raise AssertionError(f"no proof verified: {platform.worker_log()}")


@pytest.mark.services
@pytest.mark.slow
def test_ingest_completes_exactly_once_across_a_postgresql_restart(stack: private.Stack) -> None:
    ids = file_proofs(stack, 12)
    stack.start_worker()
    wait_for_some_final(stack, ids, 1)
    stack.pg.stop()  # immediate: open transactions are cut off mid-ingest
    time.sleep(3)  # tasks meet the outage and retry with backoff
    stack.pg.start()
    assert_exactly_once(settle(stack, ids), ids, stack.worker_log())


@pytest.mark.services
@pytest.mark.slow
def test_queued_ingest_jobs_survive_a_redis_crash(stack: private.Stack) -> None:
    ids = file_proofs(stack, 6)  # queued; no worker yet
    stack.redis.restart()  # SIGKILL, then start again from its append-only file
    stack.start_worker()
    assert_exactly_once(settle(stack, ids), ids, stack.worker_log())


@pytest.mark.services
@pytest.mark.slow
def test_ingest_completes_exactly_once_after_workers_are_killed(stack: private.Stack) -> None:
    ids = file_proofs(stack, 16)
    # A prefork worker whose pool child is killed: the broker redelivers at once.
    worker = stack.start_worker(pool="prefork", concurrency=1)
    wait_for_some_final(stack, ids, 1)
    children = subprocess.run(
        ["pgrep", "-P", str(worker.pid)], capture_output=True, text=True, check=False
    )
    for pid in children.stdout.split():
        os.kill(int(pid), signal.SIGKILL)
    wait_for_some_final(stack, ids, 3)
    # A solo worker killed outright: its unacknowledged message comes back once the
    # broker's visibility timeout passes, to the worker started next.
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    solo = stack.start_worker(pool="solo", concurrency=1)
    wait_for_some_final(stack, ids, 5)
    solo.send_signal(signal.SIGKILL)
    solo.wait()
    stack.start_worker(pool="prefork", concurrency=2)
    # A message a killed worker had taken comes back after the broker's visibility timeout
    # (20 s here); one it had taken but not yet recorded is lost in the broker. The
    # periodic sweep (celery beat, every 5 minutes) re-sends ingest for proofs still
    # pending; it is run here once, as beat would. Duplicates must stay harmless.
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if all(p["status"] == "valid" for p in outcome(stack).values()):
            break
        time.sleep(1)
    stack.python(
        "from attestations.proofs.tasks import requeue_stale_ingests\n"
        "print(json.dumps(requeue_stale_ingests(older_than=0)))"
    )
    assert_exactly_once(settle(stack, ids), ids, stack.worker_log())


# --- The disk fills during an upload ------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real filesystem that runs out of space (needs root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode(errors='replace')}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_the_disk_filling_during_an_upload_is_507_and_leaves_nothing_partial(
    world: World, api: Api, storage: Path, small_disk: Path, settings: Any
) -> None:
    media = small_disk / "media"
    media.mkdir()
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(media)},
        },
    }
    settings.DVBENCH = {
        **settings.DVBENCH,
        "DATA_DIR": small_disk,
        "MAX_PART_BYTES": 512 * 1024,
        "MAX_BLOB_BYTES": 8 * 1024 * 1024,
    }
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024
    keep = media / "blobs" / "keep.bin"
    keep.parent.mkdir()
    keep.write_bytes(b"stored before the disk filled")
    client = api("alice")
    data = os.urandom(3 * 512 * 1024)  # 1.5 MiB into 1 MiB
    created = open_upload(client, data)
    statuses = []
    for number, start in enumerate(range(0, len(data), 512 * 1024), start=1):
        chunk = data[start : start + 512 * 1024]
        response = client.generic(
            "PUT",
            f"/api/v1/uploads/{created['id']}/parts/{number}/",
            chunk,
            content_type="application/octet-stream",
            HTTP_X_PART_SHA256=sha256(chunk),
        )
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
    assert statuses[-1] == 507, statuses
    error = error_of(response)
    assert error["code"] == "insufficient_storage"
    assert int(response["Retry-After"]) > 0
    # Nothing partial: no temporary file left, every staged file is a whole accepted part.
    assert not list((small_disk / "tmp").glob("*"))
    parts = {p.storage_name: p for p in UploadPart.objects.filter(upload_id=created["id"])}
    for name in stored_files(media):
        if name == "blobs/keep.bin":
            continue
        assert name in parts, f"a partial file is visible: {name}"
        assert hashlib.sha256((media / name).read_bytes()).hexdigest() == parts[name].sha256
    assert keep.read_bytes() == b"stored before the disk filled"
    # Completing now is refused for the missing part, and never stores a blob.
    complete = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert complete.status_code == 409
    assert error_of(complete)["code"] in ("missing_parts", "size_mismatch")
    assert Upload.objects.get(pk=created["id"]).blob is None
    # Space comes back: the upload resumes where it stopped and completes whole.
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    for number, start in enumerate(range(0, len(data), 512 * 1024), start=1):
        if number < len(statuses):
            continue
        chunk = data[start : start + 512 * 1024]
        response = client.generic(
            "PUT",
            f"/api/v1/uploads/{created['id']}/parts/{number}/",
            chunk,
            content_type="application/octet-stream",
            HTTP_X_PART_SHA256=sha256(chunk),
        )
        assert response.status_code == 200, response.content
    done = client.post(f"/api/v1/uploads/{created['id']}/complete/")
    assert done.status_code == 200, done.content
    blob = Upload.objects.get(pk=created["id"]).blob
    assert blob is not None
    assert hashlib.sha256((media / blob.storage_name).read_bytes()).hexdigest() == sha256(data)


# --- A client disconnecting mid-request ----------------------------------------------------


def send_partial(url: str, path: str, headers: dict[str, str], body: bytes, declared: int) -> None:
    """Send headers promising ``declared`` bytes, then ``body`` (fewer), then hang up."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        head = [f"PUT {path} HTTP/1.1", f"Host: {parts.hostname}", f"Content-Length: {declared}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        conn.shutdown(socket.SHUT_RDWR)


@pytest.mark.django_db(transaction=True)
def test_a_client_disconnecting_mid_part_leaves_nothing(
    world: World, api: Api, storage: Path, live_server: Any
) -> None:
    client = api("alice")
    data = os.urandom(40 * 1024)
    created = open_upload(client, data)
    key = client._credentials["HTTP_AUTHORIZATION"]
    path = f"/api/v1/uploads/{created['id']}/parts/1/"
    headers = {
        "Authorization": key,
        "Content-Type": "application/octet-stream",
        "X-Part-SHA256": sha256(data),
    }
    send_partial(live_server.url, path, headers, data[:10_000], len(data))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and list(
        (Path(django_settings.DVBENCH["DATA_DIR"]) / "tmp").glob("*")
    ):
        time.sleep(0.1)  # the server thread notices the hang-up and cleans up
    time.sleep(0.5)
    assert not UploadPart.objects.filter(upload_id=created["id"]).exists()
    assert not list((Path(django_settings.DVBENCH["DATA_DIR"]) / "tmp").glob("*"))
    assert [n for n in stored_files(storage) if n.startswith("staging/")] == []
    # The retry of the whole part succeeds, and the upload completes.
    response = client.generic(
        "PUT", path, data, content_type="application/octet-stream", HTTP_X_PART_SHA256=sha256(data)
    )
    assert response.status_code == 200, response.content
    assert client.post(f"/api/v1/uploads/{created['id']}/complete/").status_code == 200
