"""The README's JAX quick start and the explicit-API example run as written and verify."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources import AGENT_PYTHONPATH

ROOT = Path(__file__).resolve().parents[4]


def _run(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            AGENT_PYTHONPATH,
            env.get("PYTHONPATH", ""),
        ]
    )
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
    env["PYTHONPATH"] = AGENT_PYTHONPATH
    return subprocess.run(
        [sys.executable, "-m", "zkdv", "verify", str(proof)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run and a replay, 300 s each
def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    result = _run("train_state.py", tmp_path)
    assert result.returncode == 0, result.stderr
    verified = _verify(tmp_path / "proof")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("valid: 10 steps")
    from zkdv.jax.artifact import Artifact

    artifact = Artifact.loads((tmp_path / "proof" / "program.jaxexport").read_bytes())
    # The step commits its gradient: the production step and the canonical update are
    # the committed programs, both lowered for the CPU and CUDA replay workers.
    assert artifact.commits and artifact.canonical
    assert artifact.production is not None and artifact.apply_program is not None
    assert set(artifact.production.platforms) == {"cpu", "cuda"}
    assert set(artifact.apply_program.platforms) == {"cpu", "cuda"}


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run and a replay, 300 s each
def test_basic_training_example(tmp_path: Path) -> None:
    result = _run("basic_training.py", tmp_path, str(tmp_path / "explicit"))
    assert result.returncode == 0, result.stderr
    verified = _verify(tmp_path / "explicit")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "valid: 20 steps" in verified.stdout


def _replay_in_a_fresh_process(proof: Path) -> str:
    """The platform's replay of every window, from the proof's files alone."""
    code = (
        "import sys\n"
        "from provers import jax_replay\n"
        "from provers.replay import Transcript, windows\n"
        "path = sys.argv[1]\n"
        "transition = jax_replay.load_transition(path)\n"
        "for first, last in windows(Transcript.load(path)):\n"
        "    verdict = jax_replay.verify_challenge(path, first, through=last, "
        "transition=transition)\n"
        "    assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message\n"
        "    print(first, last)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), AGENT_PYTHONPATH])
    result = subprocess.run(
        [sys.executable, "-c", code, str(proof)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run and a replay, 300 s each
def test_nnx_training_example(tmp_path: Path) -> None:
    result = _run("nnx_training.py", tmp_path, str(tmp_path / "nnx"))
    assert result.returncode == 0, result.stderr
    assert "step 40:" in result.stdout
    verified = _verify(tmp_path / "nnx")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("valid: 40 steps")
    from zkdv.jax.artifact import Artifact

    artifact = Artifact.loads((tmp_path / "nnx" / "program.jaxexport").read_bytes())
    assert artifact.source == "flax.nnx.Optimizer"
    assert artifact.commits and artifact.production is not None
    assert set(artifact.production.platforms) == {"cpu", "cuda"}
    assert _replay_in_a_fresh_process(tmp_path / "nnx").splitlines()[0] == "0 7"


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run and a replay, 300 s each
def test_scan_training_example(tmp_path: Path) -> None:
    result = _run("scan_training.py", tmp_path, str(tmp_path / "scan"))
    assert result.returncode == 0, result.stderr
    assert "updates 37-40:" in result.stdout
    verified = _verify(tmp_path / "scan")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("valid: 40 steps")
    from zkdv.jax.artifact import Artifact

    artifact = Artifact.loads((tmp_path / "scan" / "program.jaxexport").read_bytes())
    assert artifact.source == "zkdv.jax.contrib.TrainState in zkdv.jax.scan"
    assert (artifact.layout.rows, artifact.layout.cols) == (32, 65)
    # Each update commits its gradient: one update's programs, for the replay platforms.
    assert artifact.commits and artifact.canonical and artifact.production is not None
    assert set(artifact.production.platforms) == {"cpu", "cuda"}
    # Snapshots every 6 updates fall inside calls of 4: windows [0, 5], [6, 11], ...
    assert _replay_in_a_fresh_process(tmp_path / "scan").splitlines()[:2] == ["0 5", "6 11"]
