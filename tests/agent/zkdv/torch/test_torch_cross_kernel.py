"""Trained on one CPU kernel family, replayed by the platform on another: no false alarm.

The platform's replay workers are never the lab's machines. Each run here trains in a
fresh process on other kernels than this test process's (ATen's, oneDNN's and MKL's
capped together, :func:`zkdv.calibrate.kernels`) and another thread count, with the
SDK's sampled check at every step, and is then replayed window by window by the
platform's prover here: every step's recomputed gradient must land within the run's
bounds and the canonical update of the committed gradient must reproduce the committed
state bit for bit. Five (kernel family, threads) pairs, each recipe on at least one
(``ZKDV_TEST_MATRIX=full``: every pair, two seeds per recipe, ten runs each;
``tests/matrix.py``); ``docs/reliability.md`` reports a larger sweep. Every forgery of the recipe tests
is then trained on other kernels too, and still caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from provers import torch_replay
from provers.drift import combine
from provers.replay import Transcript, windows
from tests.agent.zkdv.torch.test_torch_recipes import FORGERIES, STEPS, assert_caught
from tests.matrix import cell_id, cells
from tests.sources import AGENT_PYTHONPATH
from zkdv.calibrate import kernels
from zkdv.verify import verify_transcript

ROOT = Path(__file__).resolve().parents[4]
HERE = torch.backends.cpu.get_cpu_capability().lower()
#: The kernel families below this process's own (a CPU runs every family up to its own).
OTHER = [c for c in ("default", "avx2", "avx512")[: ("default", "avx2", "avx512").index(HERE)]]
#: (kernel family, threads) the runs train under: never this process's family.
PAIRS = [(OTHER[i % len(OTHER)], threads) for i, threads in enumerate((1, 2, 4, 1, 2))]


RECIPES = ("bn", "cnn", "hf", "lm")
RUNS = 2
#: Every (pair, recipe, seed) under ZKDV_TEST_MATRIX=full; else each pair and each recipe.
CELLS = cells(len(PAIRS), RECIPES, RUNS)


def _run_elsewhere(arguments: list[str], capability: str) -> None:
    """``python ARGUMENTS`` in a process of its own on other kernels; it must succeed."""
    env = {
        **os.environ,
        **kernels(capability),
        "PYTHONPATH": os.pathsep.join([str(ROOT), AGENT_PYTHONPATH]),
    }
    result = subprocess.run(
        [sys.executable, *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _train(directory: Path, runs: list[str], capability: str, threads: int) -> None:
    """Train ``runs`` ("recipe:seed" or "forgery:name") in one process on other kernels."""
    module = "tests.agent.zkdv.torch.train_elsewhere"
    _run_elsewhere(["-m", module, str(directory), str(threads), *runs], capability)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """Per pair, every recipe's runs, trained in one process on that pair's kernels (a
    process per run would spend most of the suite's time importing Torch)."""
    done: dict[int, Path] = {}

    def runs_of(pair: int) -> Path:
        if pair not in done:
            directory = tmp_path_factory.mktemp(f"pair{pair}")
            capability, threads = PAIRS[pair]
            names = [f"recipe:{recipe}:{100 * pair + run}" for p, recipe, run in CELLS if p == pair]
            _train(directory, names, capability, threads)
            done[pair] = directory
        return done[pair]

    return runs_of


@pytest.mark.slow
@pytest.mark.parametrize(("pair", "recipe", "run"), CELLS, ids=map(cell_id, CELLS))
def test_an_honest_run_passes_the_replay_on_other_kernels(
    pair: int, recipe: str, run: int, trained: Callable[[int], Path]
) -> None:
    capability, threads = PAIRS[pair]
    path = trained(pair) / f"recipe:{recipe}:{100 * pair + run}"
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


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every forgery of the recipe tests, trained in one process on other kernels."""
    directory = tmp_path_factory.mktemp("forged")
    capability, threads = PAIRS[0]
    _train(directory, [f"forgery:{name}" for name in sorted(FORGERIES)], capability, threads)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forgery_trained_on_other_kernels_is_still_caught(forgery: str, forged: Path) -> None:
    assert_caught(forged / f"forgery:{forgery}", forgery)


#: The forgery suite's runs trained on other kernels: two snapshot windows of 12 steps
#: (the SDK's default interval), honest and with the tolerance-gap forger's pushes.
_DRIFT_RUNS = """
import sys
from pathlib import Path
import torch
from bench import forgery_suite as suite
torch.set_num_threads(int(sys.argv[2]))
suite.train(Path(sys.argv[1]) / "honest", steps=24, seed=0)
forger, _ = suite.tolerance_gap(0)
suite.train(Path(sys.argv[1]) / "forged", steps=24, seed=0, forger=forger)
"""


@pytest.mark.slow
def test_a_tolerance_gap_forgery_trained_on_other_kernels_fails_the_drift_test(
    tmp_path: Path,
) -> None:
    """Every step of the forger's windows is within the bounds of a replay on other
    kernels; what fails is that its differences point one way (``provers.drift``)."""
    capability, threads = PAIRS[0]
    _run_elsewhere(["-c", _DRIFT_RUNS, str(tmp_path), str(threads)], capability)
    verdicts = {
        run: [torch_replay.verify_challenge(tmp_path / run, a, through=a + 11) for a in (0, 12)]
        for run in ("honest", "forged")
    }
    # Every window passes alone, honest or forged: every step within the bounds, and one
    # window's 12 steps carry 11 bits of sign, not enough for the window test.
    for run, replayed in verdicts.items():
        for verdict in replayed:
            assert verdict.ok, (run, verdict.message)
            assert verdict.judgement == "within_bounds" and verdict.drift is not None
            assert all(e.gradient["margin"] < 1 for e in verdict.evidence)  # type: ignore[index]
    honest = combine([v.drift for v in verdicts["honest"]])  # type: ignore[misc]
    assert honest["p"] > 1e-3 and not honest["exceeded"]
    # The forger's differences align in every pair of both windows: the run's verdict
    # (attestations.challenges.verdicts.run_drift) rejects it.
    forged = combine([v.drift for v in verdicts["forged"]])  # type: ignore[misc]
    assert forged["exceeded"] and forged["p"] <= forged["run_p"], forged
    assert forged["windows"] == [0, 12]
    assert all(v.drift["cosine"] > 0.5 for v in verdicts["forged"])  # type: ignore[index]


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
