"""The suite's own S3 API keeps answering however much it has logged (issue 58).

moto_server writes an access-log line per request. When the session started it with its
output on a pipe nobody read, the server blocked once 64 KiB of log had piled up, and with
it every S3 call of the suite: ``./scripts/test`` stopped at 28 % on a newcomer's machine.
This test makes the server log many times that, each request bounded in time, so the hang
comes back as a failure in seconds instead of a suite that never ends.
"""

from __future__ import annotations

import time
import uuid

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.attestations.s3 import CREDENTIALS, REGION, S3Server

#: A pipe's buffer on Linux.
PIPE_BYTES = 64 * 1024
#: Each request names a missing key this long, and its access-log line holds the key, so
#: the requests below log about a megabyte: sixteen pipes' worth.
KEY_BYTES = 1000
REQUESTS = 1000


@pytest.mark.timeout(120)
def test_the_s3_server_answers_after_logging_far_more_than_a_pipe_holds(
    s3_server: S3Server,
) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["access_key"],
        aws_secret_access_key=CREDENTIALS["secret_key"],
        # A blocked server fails the request in seconds; one attempt, no retries to wait on.
        config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}),
    )
    bucket = f"dvbench-test-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    logged_before = s3_server.log.stat().st_size if s3_server.log is not None else 0
    started = time.monotonic()
    prefix = "k" * (KEY_BYTES - 8)
    for number in range(REQUESTS):
        with pytest.raises(ClientError) as missing:
            client.head_object(Bucket=bucket, Key=f"{prefix}{number:08d}")
        assert missing.value.response["Error"]["Code"] == "404", missing.value.response
    client.put_object(Bucket=bucket, Key="last", Body=b"still answering")
    assert client.get_object(Bucket=bucket, Key="last")["Body"].read() == b"still answering"
    elapsed = time.monotonic() - started

    if s3_server.log is not None:  # the server this session started: its log is a file
        logged = s3_server.log.stat().st_size - logged_before
        assert logged > 8 * PIPE_BYTES, (logged, s3_server.log_tail())
    # About 3 ms a request on two cores; a server that stalls on its log never gets here.
    assert elapsed < 90, elapsed
