"""The README's JAX quick start and the explicit-API example run as written and verify."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "agent" / "src"), env.get("PYTHONPATH", "")])
    env.pop("ZKDV_JAX_EXPORT_PLATFORMS", None)  # the default: cpu and cuda as well
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "jax" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _verify(proof: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "agent" / "src")
    return subprocess.run(
        [sys.executable, "-m", "zkdv", "verify", str(proof)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    result = _run("train_state.py", tmp_path)
    assert result.returncode == 0, result.stderr
    verified = _verify(tmp_path / "proof")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("valid: 10 steps")
    from zkdv.jax.artifact import Artifact

    artifact = Artifact.loads((tmp_path / "proof" / "program.jaxexport").read_bytes())
    assert set(artifact.attest.platforms) == {"cpu", "cuda"}


@pytest.mark.slow
def test_basic_training_example(tmp_path: Path) -> None:
    result = _run("basic_training.py", tmp_path, str(tmp_path / "explicit"))
    assert result.returncode == 0, result.stderr
    verified = _verify(tmp_path / "explicit")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "valid: 20 steps" in verified.stdout
