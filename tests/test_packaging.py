"""The SDK installs and imports without the server stack; the lock pins every install."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_ONLY = {"django", "celery", "psycopg", "psycopg-binary", "gunicorn", "redis", "kombu"}
HEAVY = ("jax", "jaxlib", "flax", "optax", "torch", "django", "celery", "psycopg", "kombu")


def load_toml(path: Path) -> dict:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints.txt line {line!r} is not pinned with =="
        pins[canonical(name)] = version
    return pins


def modules_loaded_by(statement: str) -> list[str]:
    probe = (
        f"import json, sys; {statement}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return list(json.loads(completed.stdout))


@pytest.mark.parametrize("statement", ["import zkdv", "import dvbench", "import zkdv, dvbench"])
def test_importing_the_sdk_loads_no_framework_and_no_server_stack(statement: str) -> None:
    assert modules_loaded_by(statement) == []


def test_the_framework_frontends_load_lazily() -> None:
    # zkdv.jax / zkdv.torch are reached through the package's module __getattr__ (PEP 562).
    import zkdv

    assert "jax" in dir(zkdv)
    assert "torch" in dir(zkdv)


def test_the_sdk_declares_no_server_dependency() -> None:
    project = load_toml(REPO_ROOT / "agent" / "pyproject.toml")["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    names = {canonical(Requirement(item).name) for item in declared}
    assert not names & SERVER_ONLY


def test_the_sdk_extras_are_the_frameworks() -> None:
    extras = load_toml(REPO_ROOT / "agent" / "pyproject.toml")["project"]["optional-dependencies"]
    assert {canonical(Requirement(item).name) for item in extras["jax"]} == {
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "flatbuffers",
    }
    assert [str(Requirement(item)) for item in extras["torch"]] == ["torch==2.13.0"]


def test_the_server_depends_on_the_sdk() -> None:
    dependencies = load_toml(REPO_ROOT / "pyproject.toml")["project"]["dependencies"]
    assert "dvbench" in {canonical(Requirement(item).name) for item in dependencies}


def test_the_lock_pins_every_declared_dependency() -> None:
    pins = lock()
    server = load_toml(REPO_ROOT / "pyproject.toml")["project"]
    agent = load_toml(REPO_ROOT / "agent" / "pyproject.toml")["project"]
    declared = list(server["dependencies"]) + list(agent["dependencies"])
    for group in (server["optional-dependencies"], agent["optional-dependencies"]):
        for extra in group.values():
            declared += extra
    unpinned = sorted(
        {canonical(Requirement(item).name) for item in declared} - set(pins) - {"dvbench"}
    )
    assert not unpinned, f"add to the lock with ./scripts/lock: {unpinned}"


def test_the_lock_pins_torch_to_the_cpu_build() -> None:
    assert lock()["torch"] == "2.13.0+cpu"


def test_the_environment_matches_the_lock() -> None:
    pins = lock()
    drift = {}
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "(not installed)"
        if installed != version:
            drift[name] = f"locked {version}, installed {installed}"
    assert not drift, f"run ./scripts/bootstrap (or ./scripts/lock after a change): {drift}"


def test_bootstrap_installs_through_the_lock() -> None:
    script = (REPO_ROOT / "scripts" / "bootstrap").read_text()
    assert "-c constraints.txt" in script
    assert "./agent[jax,torch,hf]" in script
