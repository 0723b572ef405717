"""The transcript file: append-only writes survive a crash; the reader reports the tail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zkdv.errors import TranscriptError, TruncatedTranscriptError
from zkdv.records import RECORDS_FILE, TranscriptWriter, iter_records

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
