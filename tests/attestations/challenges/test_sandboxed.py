"""The platform's replay children see none of its secrets (issue 59, item 3).

:mod:`attestations.challenges.sandboxed` runs every replay through ``provers.sandbox``
with the platform's data directory and key files hidden. Here the platform's settings
name real files (the generated Django secret, the signing and challenge keys under the
data directory, and a signing key mounted elsewhere), its environment holds every kind
of secret, and a child started the way a replay is started reports what it can see.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from attestations.challenges import sandboxed
from provers import sandbox

ENVIRONMENT = {
    "DJANGO_SECRET_KEY": "x" * 40,
    "DATABASE_URL": "postgres://dvbench:pw@db/dvbench",
    "REDIS_URL": "redis://redis:6379/0",
    "DVBENCH_SIGNING_KEY": "ab" * 32,
    "DVBENCH_CHALLENGE_KEY": "cd" * 32,
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
}


@pytest.fixture
def platform_keys(settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    data = tmp_path / "data"
    (data / "keys").mkdir(parents=True)
    files = [data / "secret_key", data / "keys" / "signing.key", data / "keys" / "challenge.key"]
    for path in files:
        path.write_text(f"secret of {path.name}")
    mounted = tmp_path / "secrets" / "signing.pem"
    mounted.parent.mkdir()
    mounted.write_text("mounted signing key")
    settings.DVBENCH = {**settings.DVBENCH, "DATA_DIR": data, "SIGNING_KEY_FILE": str(mounted)}
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    return [*files, mounted]


def test_the_platform_hides_its_data_directory_and_key_files(platform_keys: list[Path]) -> None:
    hidden = sandboxed.hidden_paths()
    assert str(platform_keys[0].parent.resolve()) in hidden
    assert str(platform_keys[-1].resolve()) in hidden


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces are Linux's")
def test_a_replay_child_sees_none_of_the_platforms_secrets(platform_keys: list[Path]) -> None:
    seen = sandbox.run(
        "inspect",
        {"paths": [str(p) for p in platform_keys]},
        inputs={"records.cborl": b"the lab's transcript"},
        hide=sandboxed.hidden_paths(),
    )
    for name, value in ENVIRONMENT.items():
        assert name not in seen["environment"]
        assert value not in seen["environment"].values()
    if seen["sandbox"]["namespaces"].startswith("not isolated"):
        pytest.skip(f"this kernel refuses namespaces: {seen['sandbox']['namespaces']}")
    for path in platform_keys:
        assert not seen["read"][str(path)], f"the child read {path}"


def test_the_workers_replay_environment_is_read_in_a_child_once(settings: Any) -> None:
    # Reading it opens the backend: in the worker itself, a TPU host's chip would be held
    # by the worker and no replay child could open it.
    sandboxed.replay_environment.cache_clear()
    try:
        environment = sandboxed.replay_environment("provers.jax_replay")
        assert environment["platform_kind"] == "cpu"
        assert sandboxed.replay_environment("provers.jax_replay") is environment  # cached
    finally:
        sandboxed.replay_environment.cache_clear()
    refused = sandbox.run("environment", {"prover": "os"}, inputs={})
    assert (refused["ok"], refused["reason"]) == (False, "unknown_prover")
