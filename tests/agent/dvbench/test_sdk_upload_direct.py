"""Direct uploads from the SDK: parts go to S3 (moto_server), never through the platform.

The platform runs with S3 storage and direct uploads on; a fault proxy in front of it
sees every request the SDK makes to the platform, so the tests can say that no part's
bytes passed through it, and can kill a sync half-way.
"""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from dvbench import Client
from dvbench._exceptions import DVBenchError
from dvbench._manifest import Manifest
from dvbench._sync import sync_directory
from tests.agent.dvbench.test_sdk_challenges import NAME as TORCH_NAME
from tests.agent.dvbench.test_sdk_challenges import torch_run
from tests.agent.dvbench.test_sdk_upload import make_run
from tests.attestations.challenges.test_replay import TORCH_SPEC
from tests.attestations.s3 import CREDENTIALS, REGION, s3_endpoint

__all__ = ["s3_endpoint", "torch_run"]

pytestmark = pytest.mark.django_db(transaction=True)

SNAPSHOT = "files/snapshot-00000000.params.bin"
MiB = 1024 * 1024


@pytest.fixture
def bucket(platform: Any, s3_endpoint: str, settings: Any) -> Any:
    """The platform's storage on a fresh bucket, with direct uploads; a client to read it."""
    name = f"dvbench-sdk-{uuid.uuid4().hex[:16]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["access_key"],
        aws_secret_access_key=CREDENTIALS["secret_key"],
    )
    client.create_bucket(Bucket=name)
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": name,
                "endpoint_url": s3_endpoint,
                "region_name": REGION,
                "default_acl": None,
                "file_overwrite": False,
                **CREDENTIALS,
            },
        },
    }
    settings.DVBENCH = {
        **settings.DVBENCH,
        "S3_DIRECT_UPLOADS": True,
        "MAX_PART_BYTES": 6 * MiB,
        "MAX_BLOB_BYTES": 32 * MiB,
    }

    def read(sha256: str) -> bytes:
        from attestations.uploads.models import Blob

        key = Blob.objects.get(sha256=sha256).storage_name
        return client.get_object(Bucket=name, Key=key)["Body"].read()  # type: ignore[no-any-return]

    return read


def assert_stored(read: Any, directory: Any) -> None:
    for path in [directory / "records.cborl", *sorted((directory / "files").iterdir())]:
        data = path.read_bytes()
        if data:
            assert read(hashlib.sha256(data).hexdigest()) == data, path.name


def test_a_run_uploads_straight_to_s3(platform, bucket, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(1024))  # raised to S3's least part, 5 MiB
    watch = proxy(serial=True)
    with Client(watch.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=2 * 5 * MiB + 123)
        result = sync_directory(client, directory, progress=False, parallel=3)
    assert result.complete
    # The platform saw declarations of parts, and not one byte of any part.
    assert watch.puts() == []
    entry = Manifest.load(directory).files[SNAPSHOT]
    assert entry["direct"] is True and entry["part_size"] == 5 * MiB
    declared = [s.path for s in watch.seen if entry["upload_id"] in s.path and "/url" in s.path]
    assert sorted(declared) == sorted(
        f"/api/v1/uploads/{entry['upload_id']}/parts/{n}/url/" for n in (1, 2, 3)
    )
    assert_stored(bucket, directory)
    with Client(platform.url, api_key=platform.key("alice")) as client:
        proof = client.get_proof(int(result.proof_id))  # type: ignore[arg-type]
    assert proof["status"] == "valid", proof  # the transcript was read from S3 and verified


def test_a_killed_sync_resumes_with_the_parts_s3_lacks(
    platform, bucket, proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(5 * MiB))

    def rule(method: str, path: str, n: int) -> str:
        # The platform stops answering when part 3's URL is asked for: the sync gives up.
        return "503" if path.endswith("/parts/3/url/") else "pass"

    flaky = proxy(rule, serial=True)
    with Client(flaky.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=2 * 5 * MiB + 10)
        with pytest.raises(DVBenchError):
            sync_directory(client, directory, progress=False)
    entry = Manifest.load(directory).files[SNAPSHOT]
    watch = proxy(serial=True)
    with Client(watch.url, api_key=platform.key("alice")) as client:
        result = sync_directory(client, directory, progress=False)
    assert result.complete
    assert result.bytes_resumed == 2 * 5 * MiB
    declared = [s.path for s in watch.seen if entry["upload_id"] in s.path and "/url" in s.path]
    assert declared == [f"/api/v1/uploads/{entry['upload_id']}/parts/3/url/"]
    assert_stored(bucket, directory)


def test_challenged_files_go_straight_to_s3_and_their_replays_pass(
    platform, bucket, proxy, torch_run, tmp_path, monkeypatch, settings
):
    """The demo's whole path on S3: the transcript and the challenged snapshot and batch
    files go to S3 through presigned URLs, and the platform's replays read them there."""
    from attestations.challenges.models import Challenge, ChallengeStatus
    from attestations.uploads.models import Blob

    monkeypatch.setenv("DVBENCH_UPLOAD_FILES", "challenged")
    settings.DVBENCH = {**settings.DVBENCH, "DETECTION_TARGET": 0.3}
    directory = Path(shutil.copytree(torch_run, tmp_path / "run"))
    watch = proxy(serial=True)
    with Client(watch.url, api_key=platform.key("alice")) as client:
        client.experiment(TORCH_NAME, spec=TORCH_SPEC)
        result = sync_directory(client, directory, progress=False, experiment=TORCH_NAME)
        assert result.complete and result.proof_id is not None, result.notes
        proof = client.wait_for_proof(result.proof_id, timeout=120, interval=0.2)
    assert proof["status"] == "valid", proof
    assert watch.puts() == []  # not one byte of any file through the platform
    challenges = list(Challenge.objects.filter(proof_id=result.proof_id))
    assert challenges and all(c.status == ChallengeStatus.PASSED for c in challenges), [
        (c.step, c.status, c.reason) for c in challenges
    ]
    needed = {name for c in challenges for name in c.needed_files if name.startswith("files/")}
    assert needed and result.challenged_files >= len(needed)
    for name in needed:
        data = (directory / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        assert Blob.objects.filter(sha256=digest).exists(), name
        assert bucket(digest) == data, name
