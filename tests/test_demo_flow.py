"""The README's first command, end to end, as a test: the flow ``./scripts/demo`` runs.

Two ways, both in CI. ``manage.py demo`` itself, in a subprocess on the embedded
defaults (SQLite, tasks in-process, gunicorn). And, with ``DATABASE_URL`` and
``REDIS_URL`` set, the same flow (:func:`demo.flow.run`) against a live
server in this process writing to PostgreSQL, whose tasks travel over Redis to a real
Celery worker process. The flow is what the demo runs: the SDK in a separate training
process, the REST API, and the ``dvbench`` CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from demo import flow as demo_flow
from demo.flow import Account, Outcome
from tests.conftest import EmbeddedDemo, WorkerProcess

pytestmark = pytest.mark.slow


def _accounts(data_dir: Path) -> dict[str, Account]:
    from attestations.reports.management.commands.demo import (
        ensure_admin,
        ensure_demo_accounts,
        ensure_demo_organization,
    )

    admin = ensure_admin(data_dir)
    ensure_demo_organization(admin[0])
    return ensure_demo_accounts(data_dir, admin)


def _run(url: str, tmp_path: Path) -> tuple[Outcome, list[str]]:
    lines: list[str] = []

    def write(line: str) -> None:
        lines.append(line)
        print(line)  # shown by pytest when the test fails

    outcome = demo_flow.run(url, _accounts(tmp_path), tmp_path / "report", write=write)
    return outcome, lines


def _assert_complete(outcome: Outcome, lines: list[str]) -> None:
    printed = "\n".join(lines)
    assert outcome.failures == [], printed
    assert outcome.unavailable == [], printed
    assert outcome.status == "valid", printed
    assert outcome.certificate == "PASSED", printed
    assert outcome.verified is True, printed
    # Eight numbered steps, 5 to 12, each with its timing.
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == [
        f"[{n}/12" for n in range(5, 13)
    ]
    files = outcome.files
    assert files["pdf"].read_bytes().startswith(b"%PDF-")
    html = files["html"].read_text()
    assert outcome.experiment in html and "PASSED" in html
    bundle = json.loads(files["bundle"].read_text())
    assert bundle["envelope"]["payloadType"] == "application/vnd.in-toto+json"
    # The declared data set is the one trained on, and replay backs the program.
    assert outcome.claims["dataset_commitment"] == "committed_in_transcript", printed
    assert outcome.claims["program_digest"] == "verified_by_replay", printed
    # The model learned something real: far above the 10% of guessing.
    assert outcome.accuracy is not None and outcome.accuracy > 0.5


def _verify(bundle: Path, trust_root: Path, transcript: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dvbench", "verify-report", str(bundle)]
    command += ["--trust-root", str(trust_root), "--transcript", str(transcript)]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _assert_tampering_is_caught(outcome: Outcome, tmp_path: Path) -> None:
    """The offline check is not a rubber stamp: another transcript fails it."""
    other = tmp_path / "other.cborl"
    transcript = outcome.report_dir / "proof" / "records.cborl"
    data = bytearray(transcript.read_bytes())
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    files = outcome.files
    checked = _verify(files["bundle"], files["trust root"], other)
    assert checked.returncode == 1, checked.stdout + checked.stderr


@pytest.mark.services
@pytest.mark.django_db(transaction=True)
# Three minutes; by default the same flow runs on the embedded defaults (below), and the
# worker's replays and certificates over PostgreSQL and Redis in test_replay.py and
# test_certificates_e2e.py.
@pytest.mark.long
@pytest.mark.timeout(900)  # the demo's whole flow, its full training run included
def test_the_demo_flow_passes_on_postgresql_redis_and_a_real_worker(
    live_server: object, celery_worker_process: WorkerProcess, tmp_path: Path
) -> None:
    outcome, lines = _run(str(live_server.url), tmp_path)  # type: ignore[attr-defined]
    _assert_complete(outcome, lines)
    _assert_tampering_is_caught(outcome, tmp_path)
    assert "replay_challenge" in celery_worker_process.log()


def test_the_demo_command_runs_the_flow_on_embedded_defaults(
    embedded_demo: EmbeddedDemo, tmp_path: Path
) -> None:
    """``manage.py demo`` (what ./scripts/demo runs): SQLite, tasks in-process, gunicorn.

    The session's demo (tests/conftest.py), shared with the guides and the certificate
    tests: the real command in a subprocess on a data directory of its own. It runs in CI
    too (the services are removed from its environment): this is the README's first
    command.
    """
    printed = "\n".join(embedded_demo.printed)
    assert [line.split("]")[0] for line in embedded_demo.printed if line.startswith("[")] == [
        f"[{n}/12" for n in range(2, 13)
    ], printed
    assert (
        "Demo complete: proof 1 of demo/digits-jax: valid, certificate PASSED, report verified offline"
        in printed
    )
    assert "not available" not in printed
    assert "dataset_commitment matches the declared" in printed
    report = embedded_demo.report
    assert (report / "report.pdf").read_bytes().startswith(b"%PDF-")
    assert "demo/digits-jax" in (report / "report.html").read_text()
    accounts = json.loads((embedded_demo.data / "demo-accounts.json").read_text())
    assert sorted(accounts) == ["admin", "auditor", "regulator", "trainer"]
    assert accounts["regulator"]["password"] in printed  # the credentials are printed
    files = {"bundle": report / "bundle.json", "trust root": report / "trust-root.json"}
    outcome = Outcome("demo/digits-jax", report, files=files)
    _assert_tampering_is_caught(outcome, tmp_path)
