"""The ``dvbench`` command against a live platform: login, status, experiments, reports."""

from __future__ import annotations

import io
import json
import stat
import sys
import types

import pytest

from dvbench._cli import main
from dvbench._config import credentials_path

pytestmark = pytest.mark.django_db(transaction=True)


def login(monkeypatch, key: str, *args: str) -> int:
    # A key piped on stdin, as a script or CI job would pass it (no terminal to prompt).
    monkeypatch.setattr(sys, "stdin", io.StringIO(key + "\n"))
    return main(["login", *args])


def test_login_stores_the_key_privately_and_never_prints_it(platform, monkeypatch, capsys):
    key = platform.key("alice")
    assert login(monkeypatch, key, "--base-url", platform.url) == 0
    out, err = capsys.readouterr()
    assert key not in out + err
    secret = key.split("_", 2)[2]
    assert secret not in out + err
    assert "alice" in out and "_".join(key.split("_")[:2]) in out  # the public prefix only
    path = credentials_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"api_key": key, "base_url": platform.url}
    # The stored key and URL are used when the environment names none.
    assert main(["status"]) == 0
    out, err = capsys.readouterr()
    assert "reachable: yes" in out and "identity:  alice" in out and "acme: trainer" in out
    assert key not in out + err


def test_login_with_a_wrong_key_stores_nothing(platform, monkeypatch, capsys):
    assert login(monkeypatch, "dvb_000000000000_nope", "--base-url", platform.url) == 1
    _, err = capsys.readouterr()
    assert "dvbench login" in err and "request_id" in err
    assert not credentials_path().exists()


def test_status_says_when_the_platform_is_unreachable(monkeypatch, capsys):
    monkeypatch.setenv("DVBENCH_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("DVBENCH_MAX_RETRIES", "0")
    assert main(["status"]) == 1
    assert "reachable: no" in capsys.readouterr().out


def test_experiments_create_and_list(platform, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "framework": "torch",
                "model_description": "a linear layer",
                "optimizer": "AdamW(lr=1e-3)",
                "dataset_commitment": "ab" * 32,
                "max_flops": 10**20,
            }
        )
    )
    assert main(["experiments", "create", "acme/cli-run", "--spec", str(spec)]) == 0
    assert main(["experiments", "create", "acme/cli-default"]) == 0
    assert "registered acme/cli-run" in capsys.readouterr().out
    assert main(["experiments", "list"]) == 0
    out = capsys.readouterr().out
    assert "acme/cli-run" in out and "torch" in out and "acme/cli-default" in out
    assert main(["experiments", "list", "--json", "--owner", "acme"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["id"] for e in listed} == {"acme/cli-run", "acme/cli-default"}
    # Registering twice is a clear error, not a traceback.
    assert main(["experiments", "create", "acme/cli-run"]) == 1
    assert "already registered" in capsys.readouterr().err


def test_an_outsider_cannot_create_in_another_organisation(platform, monkeypatch, capsys):
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("mallory"))
    assert main(["experiments", "create", "acme/intrusion"]) == 1
    err = capsys.readouterr().err
    assert "404" in err or "403" in err


def test_verify_report_is_handed_to_the_signing_library(monkeypatch):
    calls = []
    fake = types.ModuleType("dvbench.attest.cli")
    fake.verify_report_main = lambda argv: calls.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dvbench.attest.cli", fake)
    assert main(["verify-report", "report.json", "--key", "pub.pem"]) == 0
    assert calls == [["report.json", "--key", "pub.pem"]]


def test_report_commands_work_without_the_signing_library(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dvbench.attest.cli", None)  # import fails
    assert main(["verify-report", "x"]) == 2
    assert "not available" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    with pytest.raises(SystemExit) as caught:
        main(["sync", "--bogus"])
    assert caught.value.code == 2
