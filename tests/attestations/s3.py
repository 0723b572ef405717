"""A real S3 API for the storage tests: ``moto_server``, one process per test session.

``.ci/run`` starts one and names it in ``DVBENCH_TEST_S3_ENDPOINT``; without that variable
the session starts its own on a free port and stops it at the end, so the tests run on
any machine with the dev extra installed. Each test gets a bucket of its own, so tests
sharing the server never see each other's objects.

moto writes an access-log line for every request. Its output goes to a file under the
session's temporary directory, never to a pipe: a pipe nobody reads fills after 64 KiB
(about a thousand requests) and then blocks the server, and with it every S3 call of
the suite (issue 58). The file stays after the run; a failing test that used the server
shows its last lines (``tests/conftest.py``), and so does a server that would not start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

ENDPOINT_ENV = "DVBENCH_TEST_S3_ENDPOINT"
#: moto accepts any credentials; the storage and the test's client must agree on them.
CREDENTIALS = {"access_key": "dvbench-test", "secret_key": "dvbench-test"}
REGION = "us-east-1"
START_TIMEOUT_SECONDS = 30.0
#: How much of moto's log a failure shows.
LOG_TAIL_BYTES = 4000


@dataclass(frozen=True)
class S3Server:
    """The session's S3 API: where it answers and, when the session started it, its log."""

    endpoint: str
    #: moto_server's stdout and stderr; None for the server ``DVBENCH_TEST_S3_ENDPOINT``
    #: names, whose output is its starter's (``.ci/run`` keeps it in ``moto.log``).
    log: Path | None = None

    def log_tail(self) -> str:
        """The last lines of the server's log, or a sentence saying where it is."""
        if self.log is None:
            return f"moto_server at {self.endpoint} was started outside the suite ({ENDPOINT_ENV})"
        with self.log.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = handle.read().decode(errors="replace")
        return f"{self.log} (last {LOG_TAIL_BYTES} bytes):\n{tail}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for(port: int, process: subprocess.Popen[bytes], server: S3Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(
                    f"moto_server did not start on port {port} (exit status "
                    f"{process.returncode}): {server.log_tail()}"
                ) from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's S3 API: ``DVBENCH_TEST_S3_ENDPOINT``, or a moto_server of ours.

    Ours logs to ``moto.log`` in a temporary directory of the session, which pytest keeps
    after the run (its last three runs' directories).
    """
    named = os.environ.get(ENDPOINT_ENV, "").strip()
    if named:
        yield S3Server(named.rstrip("/"))
        return
    # The console script beside this interpreter: the venv's, whatever PATH says.
    moto_server = Path(sys.executable).with_name("moto_server")
    port = _free_port()
    server = S3Server(f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("moto") / "moto.log")
    assert server.log is not None
    with server.log.open("wb") as log:
        # The child holds its own copy of the descriptor: closing ours changes nothing.
        process = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(port, process, server)
        yield server
        # A server that died under the tests fails the session's last user of it, loudly,
        # rather than leaving a run of connection errors to explain.
        if process.poll() is not None:
            raise RuntimeError(
                f"moto_server exited during the session (status {process.returncode}): "
                f"{server.log_tail()}"
            )
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - moto ignores SIGTERM
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: S3Server) -> str:
    """The URL of the session's S3 API (``s3_server``)."""
    return s3_server.endpoint


@dataclass
class S3:
    """A fresh bucket that default storage points at, and a client to look inside it."""

    endpoint: str
    bucket: str
    client: Any  # botocore's generated S3 client: no static type

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under ``prefix``, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]


@pytest.fixture
def s3(s3_endpoint: str, storage: Path, settings: Any) -> S3:
    """Default storage on a fresh bucket of the session's S3 API.

    Configured as ``DVBENCH_S3_BUCKET`` configures it (``config/settings.py``); upload
    limits and the temporary directory are ``storage``'s.
    """
    bucket = f"dvbench-test-{uuid.uuid4().hex[:16]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["access_key"],
        aws_secret_access_key=CREDENTIALS["secret_key"],
    )
    client.create_bucket(Bucket=bucket)
    # Parts through the API (DVBENCH_S3_DIRECT_UPLOADS=0); ``s3_direct`` turns it on.
    settings.DVBENCH = {**settings.DVBENCH, "S3_DIRECT_UPLOADS": False}
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": s3_endpoint,
                "region_name": REGION,
                "default_acl": None,
                "file_overwrite": False,
                **CREDENTIALS,
            },
        },
    }
    return S3(s3_endpoint, bucket, client)


@pytest.fixture
def s3_direct(s3: S3, settings: Any) -> S3:
    """``s3`` with direct uploads on: clients PUT parts to presigned S3 URLs.

    Parts may be S3's least part size (5 MiB) and a little more, so that a file of two
    parts is the smallest multipart upload S3 accepts.
    """
    settings.DVBENCH = {
        **settings.DVBENCH,
        "S3_DIRECT_UPLOADS": True,
        "MAX_PART_BYTES": 6 * 1024 * 1024,
        "MAX_BLOB_BYTES": 32 * 1024 * 1024,
    }
    return s3
