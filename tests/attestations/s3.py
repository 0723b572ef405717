"""A real S3 API for the storage tests: ``moto_server``, one process per test session.

``.ci/run`` starts one and names it in ``DVBENCH_TEST_S3_ENDPOINT``; without that variable
the session starts its own on a free port and stops it at the end, so the tests run on
any machine with the dev extra installed. Each test gets a bucket of its own, so tests
sharing the server never see each other's objects.
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                stderr = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"moto_server did not start on port {port}: {stderr}") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of a running S3 API: ``DVBENCH_TEST_S3_ENDPOINT``, or a moto_server of ours."""
    named = os.environ.get(ENDPOINT_ENV, "").strip()
    if named:
        yield named.rstrip("/")
        return
    # The console script beside this interpreter: the venv's, whatever PATH says.
    moto_server = Path(sys.executable).with_name("moto_server")
    port = _free_port()
    process = subprocess.Popen(
        [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - moto ignores SIGTERM
            process.kill()
            process.wait()


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
