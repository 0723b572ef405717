"""A FAILED certificate never looks like success: finish(), the CLI and verify-report (issue 35).

The run here exceeds a declared limit: the spec declares ``max_flops`` of 100 and the
(synthetic) run reaches 288 FLOPs at its first step, so the platform signs a FAILED
certificate whose ``limit_violations`` claim names ``max_flops``. Everything runs for
real: the live server, its tasks, the signing key, the SDK's uploads and the ``dvbench``
CLI.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import dvbench
from dvbench import Client
from dvbench._cli import main

pytestmark = pytest.mark.django_db(transaction=True)

#: Below the synthetic run's first step (288 FLOPs).
TIGHT = {**dvbench.default_spec("jax"), "max_flops": 100}


def _train(client: Client, name: str, spec: dict[str, Any] | None = None, **finish: Any) -> Any:
    proof: Any = client.experiment(name, spec=spec).proof(backend="jax")  # a FakeDriver
    proof.start(rolling_window=4)
    proof.step()
    return proof.finish(**finish)


def _cli_as(monkeypatch, platform, actor: str) -> None:
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key(actor))


def test_finish_reports_a_failed_certificate_with_its_failed_claims(platform, fake_backend, capsys):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        result = _train(client, "acme/tight", TIGHT)
    verdict = result.verdict
    assert verdict is not None and verdict.state == "FAILED" and not verdict.passed
    assert verdict.proof_id == result.proof_id and verdict.proof_status == "valid"
    assert len(verdict.failed) == 1 and verdict.failed[0].startswith("max_flops: cumulative")
    assert "over the declared maximum of 100" in verdict.failed[0]
    err = capsys.readouterr().err
    assert f"proof {result.proof_id}: certificate FAILED" in err
    assert "failed claims:\n  max_flops: cumulative FLOPs reached 288 at step 0" in err


def test_finish_wait_raises_on_a_failed_certificate(platform, fake_backend, capsys):
    with (
        Client(platform.url, api_key=platform.key("alice")) as client,
        pytest.raises(dvbench.CertificateFailedError) as caught,
    ):
        _train(client, "acme/tight", TIGHT, wait=True, timeout=60)
    verdict = caught.value.verdict
    assert verdict.state == "FAILED" and verdict.failed[0].startswith("max_flops:")
    assert "certificate FAILED" in str(caught.value) and "max_flops" in str(caught.value)


def test_finish_wait_returns_a_passed_certificate(platform, fake_backend):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        result = _train(client, "acme/roomy", wait=True, timeout=60)
    assert result.verdict is not None and result.verdict.passed
    assert result.verdict.summary().startswith(f"proof {result.proof_id}: certificate PASSED")


def test_the_cli_says_failed_and_exits_1(platform, fake_backend, monkeypatch, capsys, tmp_path):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        failed = _train(client, "acme/tight", TIGHT).proof_id
        passed = _train(client, "acme/roomy").proof_id
    capsys.readouterr()
    _cli_as(monkeypatch, platform, "bob")  # an auditor of acme

    # The listing shows the verdicts, not only that the transcripts were valid.
    assert main(["experiments", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["acme/tight"].endswith("proofs: 1 valid; certificates: 1 FAILED")
    assert lines["acme/roomy"].endswith("proofs: 1 valid; certificates: 1 PASSED")
    assert main(["experiments", "list", "--json"]) == 0
    listed = {e["id"]: e for e in json.loads(capsys.readouterr().out)}
    assert listed["acme/tight"]["certificates"] == {"FAILED": 1}

    # proofs show: exit 1 naming the failed claim, 0 only for PASSED or --allow-failed.
    assert main(["proofs", "show", str(failed)]) == 1
    captured = capsys.readouterr()
    assert f"proof {failed}: certificate FAILED" in captured.out
    assert "  max_flops: cumulative FLOPs reached 288 at step 0" in captured.out
    assert "records FAILED: exit status 1" in captured.err
    assert main(["proofs", "show", str(failed), "--allow-failed"]) == 0
    assert "certificate FAILED" in capsys.readouterr().out
    assert main(["proofs", "show", str(failed), "--wait", "--json"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["verdict"] == "FAILED" and shown["failed"][0].startswith("max_flops:")
    assert main(["proofs", "show", str(passed)]) == 0
    assert "certificate PASSED" in capsys.readouterr().out

    # download-report saves the files either way, and its status is the verdict's.
    bundle, root = tmp_path / "bundle.json", tmp_path / "trust-root.json"
    download = ["download-report", str(failed), "-o", str(bundle), "--trust-root-out", str(root)]
    assert main(download) == 1
    captured = capsys.readouterr()
    assert bundle.is_file() and root.is_file()
    assert "certificate FAILED" in captured.out and "max_flops" in captured.out
    assert main([*download, "--allow-failed"]) == 0
    capsys.readouterr()

    # verify-report, offline: authentic but FAILED is exit 1, with the failed claims.
    monkeypatch.setenv("DVBENCH_BASE_URL", "http://127.0.0.1:9")
    verify = ["verify-report", str(bundle), "--trust-root", str(root)]
    assert main(verify) == 1
    err = capsys.readouterr().err
    assert err.startswith("verified: certificate FAILED")
    assert "failed claims:\n  max_flops: cumulative FLOPs reached 288 at step 0" in err
    assert main([*verify, "--require-passed"]) == 1
    capsys.readouterr()
    assert main([*verify, "--allow-failed"]) == 0
    assert capsys.readouterr().out.startswith("verified: certificate FAILED")


def test_sync_wait_exits_1_on_a_failed_certificate(
    platform, fake_backend, monkeypatch, capsys, tmp_path
):
    # Trained offline, uploaded later by the CLI, as a CI job would.
    with Client(platform.url, api_key=platform.key("alice")) as client:
        client.create_experiment("acme/tight", TIGHT)
    monkeypatch.setenv("DVBENCH_MODE", "offline")
    with Client(platform.url, api_key=platform.key("alice")) as client:
        proof: Any = client.experiment("acme/tight", spec=TIGHT).proof(
            backend="jax", path=tmp_path / "run"
        )
        proof.start(rolling_window=4)
        proof.step()
        assert proof.finish().offline
    monkeypatch.delenv("DVBENCH_MODE")
    _cli_as(monkeypatch, platform, "alice")
    capsys.readouterr()
    command = ["sync", str(tmp_path / "run"), "--no-progress", "--wait", "--timeout", "60"]
    assert main(command) == 1
    captured = capsys.readouterr()
    assert "certificate FAILED" in captured.out and "max_flops" in captured.out
    assert "records FAILED: exit status 1" in captured.err
    # Synced already: the second run only asks for the verdict, and accepts it on request.
    assert main([*command, "--allow-failed"]) == 0
