"""``python -m zkdv verify``: exit 0 valid, 1 rejected (reason and record), 2 usage or I/O."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.synthetic import write_synthetic_transcript
from zkdv.records import RECORDS_FILE


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zkdv", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def proof(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_transcript(tmp_path_factory.mktemp("proof"), steps=5)


def test_valid_transcript_exits_0(proof: Path) -> None:
    result = _cli("verify", str(proof))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("valid: 5 steps, 3 sampled checks passed")


def test_json_report(proof: Path) -> None:
    result = _cli("verify", str(proof), "--json")
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["steps"] == 5 and len(report["digest"]) == 64


def test_rejected_transcript_exits_1_naming_record_and_reason(proof: Path, tmp_path: Path) -> None:
    data = bytearray((proof / RECORDS_FILE).read_bytes())
    (tmp_path / RECORDS_FILE).write_bytes(bytes(data[:-7]))
    result = _cli("verify", str(tmp_path / RECORDS_FILE), "--no-probes")
    assert result.returncode == 1
    assert "rejected (truncated): record" in result.stdout


def test_missing_transcript_and_bad_usage_exit_2(tmp_path: Path) -> None:
    assert _cli("verify", str(tmp_path / "nope")).returncode == 2
    assert _cli("frobnicate").returncode == 2
    assert _cli().returncode == 2
