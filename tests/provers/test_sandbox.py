"""provers.sandbox: a replay child sees no secret, reaches no network, writes no input.

The child runs the ``inspect`` job (:mod:`provers.sandbox_jobs`), which reports what it
sees: its environment, what it reads at the platform's key paths, whether it can connect
to a server the parent listens on, whether it can write beside its inputs. The parent's
environment holds every kind of secret the platform has.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from provers import sandbox

SECRETS = {
    "SECRET_KEY": "django-secret",
    "DJANGO_SECRET_KEY": "django-secret-2",
    "DATABASE_URL": "postgres://dvbench:pw@db/dvbench",
    "REDIS_URL": "redis://redis:6379/0",
    "DVBENCH_SIGNING_KEY": "ab" * 32,
    "DVBENCH_SIGNING_KEY_FILE": "/run/secrets/signing",
    "DVBENCH_CHALLENGE_KEY": "cd" * 32,
    "DVBENCH_TSA_KEY": "tsa-key",
    "AWS_ACCESS_KEY_ID": "AKIA0000",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "DVBENCH_S3_BUCKET": "bucket",
    "DVBENCH_S3_ENDPOINT_URL": "http://minio:9000",
    "XLA_FLAGS_TOKEN": "a kept prefix does not pass a secret name",
}

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces are Linux's")


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield SECRETS


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A data directory with the platform's generated keys, and a mounted key file."""
    data = tmp_path / "data"
    (data / "keys").mkdir(parents=True)
    (data / "secret_key").write_text("generated-secret-key")
    (data / "keys" / "signing.key").write_text("signing-key-bytes")
    (data / "keys" / "challenge.key").write_text("challenge-key-bytes")
    mounted = tmp_path / "run-secrets" / "signing"
    mounted.parent.mkdir()
    mounted.write_text("mounted-signing-key")
    return {"data": data, "mounted": mounted}


def _user_namespaces_allowed() -> bool:
    """Whether a fresh single-threaded process here may unshare a user namespace."""
    import subprocess

    code = (
        "import ctypes, sys; "
        "sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x00020000) != 0)"
    )
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _inspect(keys: dict[str, Path], **arguments: Any) -> dict[str, Any]:
    paths = [
        str(keys["data"] / "secret_key"),
        str(keys["data"] / "keys" / "signing.key"),
        str(keys["data"] / "keys" / "challenge.key"),
        str(keys["mounted"]),
        "input.bin",
    ]
    return sandbox.run(
        "inspect",
        {"paths": paths, **arguments},
        inputs={"input.bin": b"the lab's bytes"},
        hide=[str(keys["data"]), str(keys["mounted"])],
    )


def test_the_child_environment_holds_no_secret(secrets: dict[str, str], keys: Any) -> None:
    seen = _inspect(keys)
    environment = seen["environment"]
    for name, value in secrets.items():
        assert name not in environment
        assert value not in environment.values()
    assert environment["OMP_NUM_THREADS"] == "1"  # what changes a replay's bits passes
    assert set(environment) <= {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "HOME", "TMPDIR"} | {
        n for n in environment if n.startswith(sandbox.KEPT_PREFIXES)
    }


def test_the_filter_is_an_allow_list() -> None:
    environment = sandbox.child_environment(
        {"PATH": "/bin", "ANYTHING": "x", "XLA_FLAGS": "--f", "JAX_SECRET": "s", "CUDA_URL": "u"}
    )
    assert environment == {"PATH": "/bin", "XLA_FLAGS": "--f"}


@linux
def test_key_files_and_the_data_directory_are_hidden(secrets: Any, keys: Any) -> None:
    seen = _inspect(keys)
    notes = seen["sandbox"]
    if notes["namespaces"].startswith("not isolated"):
        pytest.skip(f"this kernel refuses namespaces: {notes['namespaces']}")
    # Where the kernel grants user namespaces, the child takes one (nothing it imported
    # first started a thread, which would make the kernel refuse).
    assert notes["namespaces"].startswith(("user, mount", "mount")), notes
    if _user_namespaces_allowed():
        assert notes["namespaces"] == "user, mount, network"
    read = seen["read"]
    assert read["input.bin"] == "the lab's bytes"
    assert read[str(keys["data"] / "secret_key")] is None
    assert read[str(keys["data"] / "keys" / "signing.key")] is None
    assert read[str(keys["data"] / "keys" / "challenge.key")] is None
    assert read[str(keys["mounted"])] == ""  # /dev/null in its place
    assert sorted(notes["hidden"]) == sorted([str(keys["data"]), str(keys["mounted"])])
    # The parent's files are untouched by the child's mounts.
    assert (keys["data"] / "secret_key").read_text() == "generated-secret-key"


@linux
def test_the_child_has_no_network(keys: Any) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        seen = _inspect(keys, connect=["127.0.0.1", server.getsockname()[1]])
    finally:
        server.close()
    if seen["sandbox"]["namespaces"].startswith("not isolated"):
        pytest.skip(f"this kernel refuses namespaces: {seen['sandbox']['namespaces']}")
    assert seen["connect"] != "connected", seen["connect"]
    assert seen["sandbox"]["network"] == "none"


def test_the_inputs_are_read_only(keys: Any) -> None:
    seen = _inspect(keys)
    assert seen["wrote_inputs"] is False
    assert seen["inputs"] == ["input.bin"]


def test_no_descriptor_but_the_verdict_pipe_is_inherited(keys: Any) -> None:
    # A socket the parent holds open must not reach the child.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    os.set_inheritable(held.fileno(), True)
    try:
        seen = sandbox.run(
            "inspect",
            {"paths": [f"/proc/self/fd/{held.fileno()}"]},
            inputs={"input.bin": b"x"},
        )
    finally:
        held.close()
    assert next(iter(seen["read"].values())) is None


def test_resource_limits_apply_in_the_child() -> None:
    limits = sandbox.Limits(
        memory_bytes=8 * 1024**3, cpu_seconds=60, file_bytes=1024, open_files=64
    )
    seen = sandbox.run("inspect", {}, inputs={"input.bin": b"x"}, limits=limits)
    assert seen["limits"] == {"as": 8 * 1024**3, "cpu": 60, "fsize": 1024, "nofile": 64}
    # The parent's own limits are not the child's.
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] != 64


def test_a_child_that_dies_gives_no_verdict() -> None:
    with pytest.raises(sandbox.SandboxError, match="exited with status"):
        sandbox.run("no-such-job", {}, inputs={})


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVBENCH_REPLAY_MEMORY_BYTES", "1024")
    assert sandbox.Limits.from_environment().memory_bytes == 1024
    monkeypatch.setenv("DVBENCH_REPLAY_CPU_SECONDS", "ten")
    with pytest.raises(ValueError, match="DVBENCH_REPLAY_CPU_SECONDS must be a positive integer"):
        sandbox.Limits.from_environment()
