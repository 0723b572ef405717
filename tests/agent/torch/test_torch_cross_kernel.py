"""Trained on one CPU kernel family, replayed by the platform on another: no false alarm.

The platform's replay workers are never the lab's machines. Each run here trains in a
fresh process on other kernels than this test process's (ATen's, oneDNN's and MKL's
capped together, :func:`zkdv.calibrate.kernels`) and another thread count, with the
SDK's sampled check at every step, and is then replayed window by window by the
platform's prover here: every step's recomputed gradient must land within the run's
bounds and the canonical update of the committed gradient must reproduce the committed
state bit for bit. Five (kernel family, threads) pairs and two seeds per recipe, ten runs
each; ``docs/reliability.md`` reports a larger sweep. Every forgery of the recipe tests
is then trained on other kernels too, and still caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from provers import torch_replay
from provers.replay import Transcript, windows
from tests.agent.torch.test_torch_recipes import FORGERIES, STEPS, assert_caught
from zkdv.calibrate import kernels
from zkdv.verify import verify_transcript

ROOT = Path(__file__).resolve().parents[3]
HERE = torch.backends.cpu.get_cpu_capability().lower()
#: The kernel families below this process's own (a CPU runs every family up to its own).
OTHER = [c for c in ("default", "avx2", "avx512")[: ("default", "avx2", "avx512").index(HERE)]]
#: (kernel family, threads) the runs train under: never this process's family.
PAIRS = [(OTHER[i % len(OTHER)], threads) for i, threads in enumerate((1, 2, 4, 1, 2))]


def _train(
    path: Path, recipe: str, seed: int, capability: str, threads: int, forgery: str = ""
) -> None:
    """Train a recipe (or a forgery of the LM recipe) in a process on other kernels."""
    script = (
        "import sys, torch; from pathlib import Path; "
        "from tests.agent.torch import test_torch_recipes as r; "
        "torch.set_num_threads(int(sys.argv[4])); "
        "path, recipe, seed, forgery = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[5]; "
        "r.FORGERIES[forgery](path, forgery, r.NO_CHECKS) if forgery else "
        "r.RECIPES[recipe](path, seed=seed, zkdv_config=r.EVERY_STEP)"
    )
    env = {
        **os.environ,
        **kernels(capability),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "agent" / "src")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), recipe, str(seed), str(threads), forgery],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("run", range(2))
@pytest.mark.parametrize("pair", range(len(PAIRS)))
@pytest.mark.parametrize("recipe", ["bn", "cnn", "hf", "lm"])
def test_an_honest_run_passes_the_replay_on_other_kernels(
    recipe: str, pair: int, run: int, tmp_path: Path
) -> None:
    if recipe == "hf":
        pytest.importorskip("transformers")
    capability, threads = PAIRS[pair]
    path = tmp_path / "proof"
    _train(path, recipe, seed=100 * pair + run, capability=capability, threads=threads)
    report = verify_transcript(path)
    assert report.ok and report.checks == STEPS, report.summary()  # the lab's own checks
    env = report.root["env"]
    assert (env["cpu_capability"].lower(), env["threads"]) == (capability, threads)
    transcript = Transcript.load(path)
    assert not torch_replay.exact_environment(transcript.root)
    transition = torch_replay.load_transition(path)
    replayed = []
    for first, last in windows(transcript):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        for evidence in verdict.evidence:
            assert evidence.gradient is not None and evidence.gradient["margin"] < 1
        replayed += [evidence.step for evidence in verdict.evidence]
    assert replayed == list(range(STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forgery_trained_on_other_kernels_is_still_caught(forgery: str, tmp_path: Path) -> None:
    capability, threads = PAIRS[0]
    path = tmp_path / "proof"
    _train(path, "", seed=0, capability=capability, threads=threads, forgery=forgery)
    assert_caught(path, forgery)


@pytest.mark.slow
def test_the_prepared_gpu_measurement_runs(tmp_path: Path) -> None:
    """scripts/gpu-cross-hardware, the measurement a lent GPU runs, as a CPU smoke run."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu-cross-hardware"),
            "--device",
            "cpu",
            "--steps",
            "2",
            "--recipes",
            "bn",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    import json

    results = json.loads((tmp_path / "gpu-cross-hardware.json").read_text())
    (run,) = results["runs"]
    assert run["sdk_checks"] == "passed" and run["failures"] == [] and run["replayed_steps"] == 2
    assert results["canonical"]["equal"] and results["canonical"]["float32_division_is_ieee"]
