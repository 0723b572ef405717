"""Parts of one file sent side by side (``--parallel``), retried alone, and the progress callback."""

from __future__ import annotations

import threading

import pytest

from dvbench import Client
from dvbench._cli import main as cli
from dvbench._manifest import Manifest
from dvbench._sync import sync_directory
from dvbench._transfer import DIRECT_PARALLEL, FileUploader
from tests.agent.dvbench.test_sdk_upload import PART, assert_on_platform, make_run

pytestmark = pytest.mark.django_db(transaction=True)

SNAPSHOT = "files/snapshot-00000000.params.bin"


def test_parts_of_one_file_go_side_by_side(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    # serial: the live server takes one request at a time (conftest); the proxy still
    # counts how many the client had in flight.
    slow = proxy(lambda method, path, n: "slow" if "/parts/" in path else "pass", serial=True)
    slow.slow_seconds = 0.2
    with Client(slow.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=8 * PART)
        result = sync_directory(client, directory, progress=False, parallel=4)
    # DVBENCH_UPLOAD_CONCURRENCY is 1 here (conftest): only the parts of one file overlap.
    assert 2 <= slow.max_concurrent <= 4
    upload_id = Manifest.load(directory).files[SNAPSHOT]["upload_id"]
    sent = sorted(int(s.path.rsplit("/", 2)[1]) for s in slow.puts() if upload_id in s.path)
    assert sent == list(range(1, 9))
    assert_on_platform(platform, directory, result.proof_id)


def test_a_failed_part_is_retried_alone(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    monkeypatch.setenv("DVBENCH_RETRY_BACKOFF", "0.01")
    # Part 3's first two attempts are 503s and part 5's first is cut off mid-body.
    faults = {("/parts/3/", 0): "503", ("/parts/3/", 1): "503", ("/parts/5/", 0): "cut"}

    def rule(method: str, path: str, n: int) -> str:
        for (suffix, attempt), action in faults.items():
            if path.endswith(suffix) and n == attempt:
                return action
        return "pass"

    flaky = proxy(rule, serial=True)
    with Client(flaky.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=6 * PART)
        result = sync_directory(client, directory, progress=False, parallel=3)
    upload_id = Manifest.load(directory).files[SNAPSHOT]["upload_id"]
    tries: dict[str, int] = {}
    for seen in flaky.puts():
        if upload_id in seen.path:
            number = seen.path.rsplit("/", 2)[1]
            tries[number] = tries.get(number, 0) + 1
    assert tries == {"1": 1, "2": 1, "3": 3, "4": 1, "5": 2, "6": 1}
    assert_on_platform(platform, directory, result.proof_id)


def test_the_progress_callback_counts_every_byte(platform, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def on_progress(done: int, total: int) -> None:
        with lock:
            calls.append((done, total))

    serial = proxy(serial=True)
    with Client(serial.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=5 * PART + 7)
        sync_directory(client, directory, progress=False, parallel=2, on_progress=on_progress)
    sizes = [
        path.stat().st_size
        for path in [*directory.iterdir(), *(directory / "files").iterdir()]
        if path.is_file() and Manifest.load(directory).files.get(str(path.relative_to(directory)))
    ]
    total = sum(sizes)
    assert calls, "the callback was never called"
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never goes back
    assert calls[-1][0] == total


def test_the_cli_takes_parallel(platform, proxy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DVBENCH_PART_SIZE", str(PART))
    watch = proxy(lambda method, path, n: "slow" if "/parts/" in path else "pass", serial=True)
    watch.slow_seconds = 0.2
    with Client(platform.url, api_key=platform.key("alice")) as client:
        directory = make_run(client, tmp_path / "run", extra=4 * PART)
    monkeypatch.setenv("DVBENCH_BASE_URL", watch.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    assert cli(["sync", "--no-progress", "--parallel", "0", str(directory)]) == 2
    assert "--parallel must be at least 1, got 0" in capsys.readouterr().err
    assert cli(["sync", "--no-progress", "--parallel", "2", str(directory)]) == 0
    assert watch.max_concurrent == 2
    assert Manifest.load(directory).data["synced"]


def test_parts_in_flight_follow_where_they_go_unless_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("DVBENCH_UPLOAD_PARALLEL", raising=False)
    manifest = Manifest(tmp_path, {"files": {}, "experiment": "acme/run"})
    to_platform, to_storage = {"direct": False}, {"direct": True}
    with Client("http://127.0.0.1:9", api_key="k") as client:
        default = FileUploader(client, manifest)
        # In order to the platform (written in place); side by side to object storage.
        assert default.parts_in_flight(to_platform) == 1
        assert default.parts_in_flight(to_storage) == DIRECT_PARALLEL == 4
        assert FileUploader(client, manifest, parallel=3).parts_in_flight(to_platform) == 3
        assert FileUploader(client, manifest, parallel=1).parts_in_flight(to_storage) == 1
    monkeypatch.setenv("DVBENCH_UPLOAD_PARALLEL", "2")
    with Client("http://127.0.0.1:9", api_key="k") as client:
        configured = FileUploader(client, manifest)
        assert configured.parts_in_flight(to_platform) == 2
        assert configured.parts_in_flight(to_storage) == 2
