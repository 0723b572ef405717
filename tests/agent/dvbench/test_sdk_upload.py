"""Uploads against a live platform, through a proxy that cuts connections and answers 503s."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dvbench
from dvbench import Client
from dvbench._cli import main as cli
from dvbench._manifest import MANIFEST, Manifest
from dvbench._sync import sync_directory
from tests.synthetic import write_synthetic_transcript

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "acme/uploads"
PART = 1024


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_run(client: Client, directory: Path, *, seed: int = 0, extra: int = 5000) -> Path:
    """A finished proof directory of ``NAME``: a real transcript plus snapshot-like files."""
    experiment = client.experiment(NAME, spec=dvbench.default_spec("jax"))
    write_synthetic_transcript(
        directory, steps=6, experiment=NAME, spec_digest=experiment.spec_digest, seed=seed
    )
    files = directory / "files"
    files.mkdir(exist_ok=True)
    (files / "snapshot-00000000.params.bin").write_bytes(os.urandom(extra))
    (files / "snapshot-00000000.buffers.bin").write_bytes(b"")
    (files / "batch-00000000.u32").write_bytes(b"\x01" * 64)
    (files / "batch-00000001.u32").write_bytes(b"\x01" * 64)  # same bytes: sent once
    manifest = Manifest.create(
        directory,
        experiment=NAME,
        spec_digest=str(experiment.spec_digest),
        backend="jax",
        base_url=client.base_url,
        ephemeral=False,
    )
    manifest.update(finished=True)
    return directory


def assert_on_platform(platform, directory: Path, proof_id: int | None) -> None:
    """Every non-empty file is stored byte for byte; the proof was filed and verified."""
    for path in [directory / "records.cborl", *sorted((directory / "files").iterdir())]:
        data = path.read_bytes()
        if data:
            assert platform.blob(sha256(data)) == data, path.name
    with Client(platform.url, api_key=platform.key("alice")) as client:
        assert proof_id is not None
        proof = client.get_proof(proof_id)
    assert proof["status"] == "valid", proof
    assert proof["transcript_sha256"] == sha256((directory / "records.cborl").read_bytes())


def test_sync_uploads_a_directory_and_marks_it(platform, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    with Client(platform.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run")
        result = sync_directory(client, directory, progress=False)
        assert result.complete and result.proof_id is not None
        # Two identical batch files: the second is deduplicated, not sent again.
        assert result.files_deduplicated == 1
        assert_on_platform(platform, directory, result.proof_id)
        manifest = json.loads((directory / MANIFEST).read_text())
        assert manifest["synced"] and manifest["proof"] == result.proof_id
        statuses = {name: entry["status"] for name, entry in manifest["files"].items()}
        assert statuses["records.cborl"] == "complete"
        assert statuses["files/snapshot-00000000.buffers.bin"] == "empty"
        assert client.wait_for_proof(result.proof_id)["status"] == "valid"
        # Syncing again sends nothing and names the same proof.
        again = sync_directory(client, directory, progress=False)
        assert again.bytes_sent == 0 and again.proof_id == result.proof_id


def test_a_connection_cut_mid_part_and_a_burst_of_503s(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    hits = {"n": 0}

    def rule(method: str, path: str, n: int) -> str:
        hits["n"] += 1
        if 3 <= hits["n"] <= 6:
            return "503"  # a burst on whatever comes 3rd to 6th
        if method == "PUT" and path.endswith("/parts/2/") and n == 0:
            return "cut"  # the first attempt at part 2 of each upload dies half-way
        if hits["n"] == 9:
            return "429"
        return "pass"

    faulty = proxy(rule)
    with Client(faulty.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=4 * PART + 100)
        result = sync_directory(client, directory, progress=False)
    assert result.complete
    actions = [s.action for s in faulty.seen]
    assert actions.count("503") == 4 and "429" in actions and "cut" in actions
    cut = faulty.puts("cut")
    # Each cut part was sent again, whole, on a new connection.
    for seen in cut:
        retried = [s for s in faulty.puts("pass") if s.path == seen.path]
        assert retried and retried[0].body_bytes == seen.body_bytes
    assert_on_platform(platform, directory, result.proof_id)


def test_retries_give_up_with_a_network_error(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_MAX_RETRIES", "2")
    faulty = proxy(lambda method, path, n: "cut" if method == "PUT" else "pass")
    with Client(faulty.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run")
        with pytest.raises(dvbench.NetworkError) as caught:
            sync_directory(client, directory, progress=False)
    assert caught.value.attempts == 3
    assert any("dvbench sync" in note for note in caught.value.__notes__)
    # Nothing is lost: a sync on a healthy network finishes it.
    with Client(platform.url, api_key=platform.key("alice")) as client:
        result = sync_directory(client, directory, progress=False)
    assert_on_platform(platform, directory, result.proof_id)


KILLED = """
import sys
from dvbench._cli import main
sys.exit(main(["sync", "--no-progress", sys.argv[1]]))
"""


def test_a_process_killed_during_upload_is_finished_by_dvbench_sync(
    platform, proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    with Client(platform.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=6 * PART)
    snapshot = "files/snapshot-00000000.params.bin"
    # The first process hangs on part 4 of the snapshot and is killed there.
    stall = proxy(lambda method, path, n: "hang" if path.endswith("/parts/4/") else "pass")
    environment = {
        **os.environ,
        "DVBENCH_BASE_URL": stall.url,
        "DVBENCH_API_KEY": platform.key("alice"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    process = subprocess.Popen([sys.executable, "-c", KILLED, str(directory)], env=environment)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entry = Manifest.load(directory).files.get(snapshot, {})
            if len(entry.get("parts", {})) == 3:
                break
            assert process.poll() is None, "the uploading process ended early"
            time.sleep(0.05)
        else:
            pytest.fail("the upload never reached part 4")
        process.kill()
    finally:
        process.wait()
    # A new process (here: the CLI in-process) resumes: parts 1-3 are not sent again.
    watch = proxy()
    monkeypatch.setenv("DVBENCH_BASE_URL", watch.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    assert cli(["sync", "--no-progress", str(directory)]) == 0
    upload_id = Manifest.load(directory).files[snapshot]["upload_id"]
    resent = sorted(s.path.rsplit("/parts/", 1)[1] for s in watch.puts() if upload_id in s.path)
    assert resent == ["4/", "5/", "6/"]
    manifest = Manifest.load(directory)
    assert manifest.data["synced"]
    assert_on_platform(platform, directory, manifest.data["proof"])


def test_a_transcript_of_another_experiment_is_refused(platform, tmp_path):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run")
        other = client.experiment("acme/other", spec=dvbench.default_spec("jax"))
        manifest = Manifest.load(directory)
        manifest.update(experiment=other.name, spec_digest=other.spec_digest)
        with pytest.raises(dvbench.BadRequestError) as caught:
            sync_directory(client, directory, progress=False)
    assert caught.value.status_code == 422
    assert caught.value.code == "experiment_mismatch"


def test_files_upload_concurrently_and_identical_ones_once(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_UPLOAD_CONCURRENCY", "4")
    busy = proxy(lambda method, path, n: "slow" if method == "PUT" else "pass", serial=True)
    busy.slow_seconds = 0.05
    with Client(busy.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run")
        files = directory / "files"
        for step in range(2, 8):  # six more copies of the same batch
            (files / f"batch-{step:08d}.u32").write_bytes(b"\x01" * 64)
        for step in range(8, 12):
            (files / f"batch-{step:08d}.u32").write_bytes(os.urandom(64))
        result = sync_directory(client, directory, progress=False)
        batches = [
            u for u in client.paginate("uploads/", {"experiment": NAME}) if u["kind"] == "batch"
        ]
    assert busy.max_concurrent >= 2  # several files were in flight at once
    assert result.files_deduplicated == 7  # eight identical batches, one sent
    assert len(batches) == 5
    assert_on_platform(platform, directory, result.proof_id)


def test_a_part_lost_after_a_200_is_sent_again_at_completion(
    platform, proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    liar = proxy(lambda method, path, n: "lie" if path.endswith("/parts/2/") and n == 0 else "pass")
    with Client(liar.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=3 * PART)
        result = sync_directory(client, directory, progress=False)
    # The platform named what it lacked at completion; the client sent it and completed.
    lied = liar.puts("lie")
    assert lied and all(
        any(s.path == lie.path and s.action == "pass" for s in liar.puts()) for lie in lied
    )
    assert_on_platform(platform, directory, result.proof_id)
