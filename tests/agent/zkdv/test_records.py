"""The transcript file: append-only writes survive a crash; the reader reports the tail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zkdv.errors import TranscriptError, TruncatedTranscriptError
from zkdv.records import PROBES_FILE, RECORDS_FILE, TranscriptWriter, iter_records

WRITER = """
import sys
from zkdv.records import TranscriptWriter
writer = TranscriptWriter(sys.argv[1], fsync_every=1000)
i = 0
while True:
    writer.append({"t": "step", "i": i, "pad": b"x" * (i % 4096)})
    i += 1
    if i == 200:
        print("ready", flush=True)
"""


def test_a_killed_writer_never_corrupts_earlier_records(tmp_path: Path) -> None:
    for attempt in range(3):
        directory = tmp_path / f"run{attempt}"
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(0.05 * attempt)
        process.send_signal(signal.SIGKILL)
        process.wait()
        data = (directory / RECORDS_FILE).read_bytes()
        seen = 0
        try:
            for record in iter_records(data):
                assert record.data["i"] == seen
                seen += 1
        except TruncatedTranscriptError as error:
            # Only the very last record may be incomplete.
            assert error.record == seen
        assert seen >= 200


BACKGROUND_WRITER = """
import sys
from zkdv.records import TranscriptWriter
writer = TranscriptWriter(sys.argv[1], fsync_every=1000, background=True)
i = 0
while True:
    writer.append({"t": "step", "i": i, "pad": b"x" * (i % 4096)})
    i += 1
    if i == 200:
        writer.flush()  # records 0-199 are committed now
        print("ready", flush=True)
"""


def test_a_killed_background_writer_loses_no_committed_record(tmp_path: Path) -> None:
    for attempt in range(3):
        directory = tmp_path / f"run{attempt}"
        process = subprocess.Popen(
            [sys.executable, "-c", BACKGROUND_WRITER, str(directory)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(0.05 * attempt)
        process.send_signal(signal.SIGKILL)
        process.wait()
        seen = 0
        try:
            for record in iter_records((directory / RECORDS_FILE).read_bytes()):
                assert record.data["i"] == seen
                seen += 1
        except TruncatedTranscriptError as error:
            assert error.record == seen  # only the very last record may be incomplete
        assert seen >= 200


def _write_run(directory: Path, *, background: bool) -> None:
    writer = TranscriptWriter(directory, fsync_every=3, background=background)
    writer.append({"t": "root"}, sync=True)
    for i in range(10):
        probe = writer.append_probes(bytes([i]) * (7 + i))
        name = directory / f"file-{i}"
        writer.submit(lambda name=name, i=i: name.write_bytes(bytes([i]) * 5), 5)
        writer.append({"t": "step", "i": i, "probe": probe}, sync=i % 4 == 0)
    writer.close()


def test_a_background_writer_writes_the_same_bytes(tmp_path: Path) -> None:
    _write_run(tmp_path / "sync", background=False)
    _write_run(tmp_path / "background", background=True)
    for name in (RECORDS_FILE, PROBES_FILE, "file-9"):
        assert (tmp_path / "sync" / name).read_bytes() == (
            tmp_path / "background" / name
        ).read_bytes()


def test_a_record_is_committed_after_what_was_queued_before_it(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path, background=True)
    seen: list[tuple[int, int]] = []
    for i in range(20):
        probe = writer.append_probes(b"p" * 16)
        # Each file job sees every earlier record and probe block written, and no later one.
        writer.submit(
            lambda: seen.append(
                (
                    (tmp_path / RECORDS_FILE).stat().st_size,
                    (tmp_path / PROBES_FILE).stat().st_size,
                )
            )
        )
        writer.append({"t": "step", "i": i, "probe": probe})
    writer.close()
    sizes = [record.offset for record in iter_records(tmp_path)]
    assert seen == [(sizes[i], 16 * (i + 1)) for i in range(20)]


def test_a_background_writer_bounds_its_queue(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path, background=True, max_pending_bytes=100)
    gate = threading.Event()
    writer.submit(gate.wait, 60)
    appended = threading.Event()

    def append() -> None:
        writer.append({"t": "step", "pad": b"x" * 64})  # 60 + ~75 bytes > 100: waits
        appended.set()

    thread = threading.Thread(target=append)
    thread.start()
    try:
        # Not a timing assertion: it waits until the gate opens, however long this is.
        assert not appended.wait(0.3)
    finally:
        gate.set()
    thread.join()
    assert appended.is_set()
    writer.close()
    assert len(list(iter_records(tmp_path))) == 1


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path, background=True)
    writer.append({"t": "root"})

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    writer.append({"t": "step", "i": 0})  # queued behind the failure: never written
    with pytest.raises(OSError, match="No space left on device"):
        writer.flush()
    with pytest.raises(OSError, match="transcript writer failed"):
        writer.append({"t": "step", "i": 1})
    with pytest.raises(OSError):
        writer.close()
    assert [r.data["t"] for r in iter_records(tmp_path)] == ["root"]


def test_writer_refuses_to_append_to_another_runs_transcript(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path)
    writer.append({"t": "root"})
    writer.close()
    with pytest.raises(FileExistsError, match="use a new proof directory"):
        TranscriptWriter(tmp_path)


def test_records_are_hash_chained_and_hashes_are_of_the_exact_bytes(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path)
    hashes = [writer.append({"t": "x", "i": i}) for i in range(3)]
    writer.close()
    records = list(iter_records(tmp_path))
    assert [r.hash for r in records] == hashes
    assert records[1].data["prev"] == hashes[0] and records[2].data["prev"] == hashes[1]
    assert writer.digest == hashes[-1]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01", "expected a CBOR map"),
        (b"\xa1\x61t" + b"\x9f" * 80, "nesting deeper than 64"),
        (b"\xa1\x61t\x5b\x00\x00\x00\x01\x00\x00\x00\x00", "over the record limit"),
        (b"\xff", "unexpected CBOR break"),
        (b"\xa1\x61t\x1c", "invalid CBOR additional information 28"),
        (b"\xa1\x61t\x62\xff\xfe", "not a valid CBOR record"),  # invalid UTF-8 text
    ],
)
def test_malformed_records_get_a_precise_error(data: bytes, message: str) -> None:
    with pytest.raises(TranscriptError, match=message) as raised:
        list(iter_records(data))
    assert raised.value.record == 0


def test_reader_streams_a_large_file_without_reading_it_twice(tmp_path: Path) -> None:
    writer = TranscriptWriter(tmp_path)
    for i in range(5000):
        writer.append({"t": "step", "i": i})
    writer.close()
    size = os.path.getsize(tmp_path / RECORDS_FILE)
    records = list(iter_records(tmp_path))
    assert len(records) == 5000
    assert sum(r.size for r in records) == size
