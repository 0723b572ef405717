"""``dvbench verify-report``: exit 0 verified and PASSED, 1 rejected or FAILED with the reason,
2 usage; no network."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from dvbench.attest import Result, TrustRoot
from dvbench.attest.cli import verify_report_main
from tests.sources import AGENT_PYTHONPATH
from tests.synthetic import write_synthetic_transcript
from zkdv.verify import verify_transcript

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture
def files(tmp_path: Path, bundle: dict[str, Any], trust_root_v2: TrustRoot) -> tuple[Path, Path]:
    """A bundle issued under v1, and the auditor's current trust root (v2) on disk."""
    bundle_path = tmp_path / "report.json"
    bundle_path.write_text(json.dumps(bundle, indent=2))
    root_path = tmp_path / "trust-root.json"
    root_path.write_text(json.dumps(trust_root_v2.to_dict(), indent=2))
    return bundle_path, root_path


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify-report opened a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_valid_bundle_exits_0(
    files: tuple[Path, Path], no_network: None, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, root = files
    assert verify_report_main([str(bundle), "--trust-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verified: certificate PASSED issued 2026-03-14T15:09:26Z by key ")


def test_json_output(files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bundle, root = files
    assert verify_report_main([str(bundle), "--trust-root", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["reason"] is None
    assert report["statement"]["predicate"]["result"] == "PASSED"
    assert report["checkpoint"]["origin"] == "dvbench.example/log"


def test_a_tampered_bundle_exits_1_with_the_reason(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, root = files
    document = json.loads(bundle.read_text())
    document["inclusion_proof"]["hashes"][0] = "00" * 32
    bundle.write_text(json.dumps(document))
    assert verify_report_main([str(bundle), "--trust-root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "rejected (bad_proof): inclusion proof for leaf 3 does not lead to the root"
    )


def test_unreadable_inputs_exit_1(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, root = files
    assert verify_report_main([str(tmp_path / "absent.json"), "--trust-root", str(root)]) == 1
    assert "cannot read bundle" in capsys.readouterr().err
    assert verify_report_main([str(bundle), "--trust-root", str(tmp_path / "absent.json")]) == 1
    assert "cannot read trust root" in capsys.readouterr().err
    root.write_text("{}")
    assert verify_report_main([str(bundle), "--trust-root", str(root), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["reason"] == "malformed"


def test_usage_errors_exit_2(files: tuple[Path, Path]) -> None:
    bundle, _ = files
    with pytest.raises(SystemExit) as exit_info:
        verify_report_main([str(bundle)])  # --trust-root is required
    assert exit_info.value.code == 2


def test_transcript_option(
    platform: Any, trust_root_v1: TrustRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proof = write_synthetic_transcript(tmp_path / "proof", steps=3)
    report = verify_transcript(proof)
    assert report.digest and report.final
    bundle = platform.issue(transcript_digest=report.digest, final_parameter_root=report.final["p"])
    bundle_path = tmp_path / "report.json"
    bundle_path.write_text(json.dumps(bundle))
    root_path = tmp_path / "root.json"
    root_path.write_bytes(trust_root_v1.to_json())
    args = [str(bundle_path), "--trust-root", str(root_path)]
    assert verify_report_main([*args, "--transcript", str(proof)]) == 0
    assert "matches the local transcript" in capsys.readouterr().out
    other = write_synthetic_transcript(tmp_path / "other", steps=3, seed=7)
    assert verify_report_main([*args, "--transcript", str(other)]) == 1
    assert "rejected (subject_mismatch)" in capsys.readouterr().err


def test_a_failed_certificate_exits_1_unless_allowed(
    platform: Any, trust_root_v1: TrustRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle_path = tmp_path / "report.json"
    bundle_path.write_text(json.dumps(platform.issue(result=Result.FAILED)))
    root_path = tmp_path / "root.json"
    root_path.write_bytes(trust_root_v1.to_json())
    args = [str(bundle_path), "--trust-root", str(root_path)]
    # Authentic, but FAILED: not a success for a script that checks the exit status.
    assert verify_report_main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("verified: certificate FAILED issued 2026-03-14T15:09:26Z")
    assert "failed claims:" in captured.err
    assert "records FAILED: exit status 1 (--allow-failed exits 0" in captured.err
    # --require-passed is the default now, and still accepted.
    assert verify_report_main([*args, "--require-passed"]) == 1
    capsys.readouterr()
    # Inspecting a failure on purpose: exit 0, the summary on stdout.
    assert verify_report_main([*args, "--allow-failed"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("verified: certificate FAILED") and captured.err == ""
    assert verify_report_main([*args, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["result"], report["accepted"]) == (True, "FAILED", False)
    assert verify_report_main([*args, "--json", "--allow-failed"]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True


def test_allow_failed_does_not_accept_a_rejected_bundle(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, root = files
    document = json.loads(bundle.read_text())
    document["inclusion_proof"]["hashes"][0] = "00" * 32
    bundle.write_text(json.dumps(document))
    assert verify_report_main([str(bundle), "--trust-root", str(root), "--allow-failed"]) == 1
    assert capsys.readouterr().err.startswith("rejected (bad_proof)")


def test_it_runs_as_a_module_without_django(files: tuple[Path, Path]) -> None:
    bundle, root = files
    script = (
        "import sys\n"
        "from dvbench.attest.cli import verify_report_main\n"
        f"code = verify_report_main([{str(bundle)!r}, '--trust-root', {str(root)!r}])\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'django'], 'django imported'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={
            "PYTHONPATH": AGENT_PYTHONPATH,
            "PATH": "/usr/bin:/bin",
        },
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("verified: ")


def test_time_of_verification_does_not_matter_to_old_certificates(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Years later, after the key's retirement, the certificate still verifies.
    import dvbench.attest._bundle as module

    class Later(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Later:
            return cls(2031, 1, 1, tzinfo=UTC)

    monkeypatch.setattr(module, "datetime", Later)
    bundle, root = files
    assert verify_report_main([str(bundle), "--trust-root", str(root)]) == 0
