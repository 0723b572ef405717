"""``python -m zkdv calibrate``: a lab's own step, recomputed under other kernel environments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv.calibrate import default_environments, kernels, measure
from zkdv.records import iter_records

STEPS = 3


def _run(
    path: Path, bounds: zkdv.GradientBounds | None = None, gradient_files: str = "auto"
) -> Path:
    """A BatchNorm classifier's first steps: the bias in front of the BatchNorm has a
    zero true gradient, so its computed gradient is rounding noise on every machine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0),
        gradient_bounds=bounds,
        gradient_files=gradient_files,
    )
    proof = zkdv.torch.ZKDV(path, config, replay_snapshot_interval=2)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def step(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs), targets))
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = (
            torch.randn(32, 12, generator=generator),
            torch.randint(3, (32,), generator=generator),
        )
        with proof.transaction(batch=batch):
            step(model, optimizer, batch)
    proof.close()
    return path


def _calibrate(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zkdv", "calibrate", str(path), *options],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_run_reproduces_itself_here_exactly(tmp_path: Path) -> None:
    rows = list(measure(_run(tmp_path / "proof"), STEPS))
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert all(row["exact"] and row["state_exact"] and row["margin"] == 0 for row in rows)


def test_other_threads_land_within_the_bounds_and_the_state_is_exact(tmp_path: Path) -> None:
    result = _calibrate(_run(tmp_path / "proof"), "--env", "threads=1", "--env", "threads=3")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "float32 gradient program, 3 committed steps" in lines[0]
    table = {line.split()[0]: line.split() for line in lines if line.startswith(("as", "threads"))}
    assert table["as"][3:6] == ["3", "3", "exact"]  # as trained: every step bitwise
    assert table["threads=1"][1:4] == ["3", "0", "exact"]  # other bits, the same state
    assert float(table["threads=1"][4]) < 0.1
    assert "margin" in result.stdout and "bounds with a 10x margin" in result.stdout


def test_bounds_below_the_honest_divergence_are_reported(tmp_path: Path) -> None:
    path = _run(tmp_path / "proof", zkdv.GradientBounds(tensor=0.0, total=0.0, scale=0.0))
    result = _calibrate(path, "--env", "threads=1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "would reject this honest run" in result.stdout


def test_a_run_without_committed_gradients_has_nothing_to_calibrate(tmp_path: Path) -> None:
    from tests.synthetic import write_synthetic_transcript

    path = write_synthetic_transcript(tmp_path / "proof")
    result = _calibrate(path)
    assert result.returncode == 2 and "commits no gradients" in result.stdout + result.stderr


def test_a_run_that_keeps_no_gradient_files_says_how_to_calibrate(tmp_path: Path) -> None:
    path = _run(tmp_path / "proof", gradient_files="never")
    assert not list((path / "files").glob("grad-*"))
    result = _calibrate(path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "gradient_files='always'" in result.stdout + result.stderr


def test_default_environments_cover_the_cpu_kernel_families_and_threads(tmp_path: Path) -> None:
    root = next(iter_records(_run(tmp_path / "proof"))).data
    names = [environment.name for environment in default_environments(root)]
    assert "kernels=default" in names and "threads=1" in names
    trained = root["env"]["cpu_capability"].lower()
    assert f"kernels={trained}" not in names
    assert kernels("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"


@pytest.mark.parametrize(
    ("spec", "words"), [("nonsense", "is not NAME=VALUE"), ("threads=0", "positive integer")]
)
def test_an_environment_must_be_name_value_pairs(tmp_path: Path, spec: str, words: str) -> None:
    result = _calibrate(_run(tmp_path / "proof"), "--env", spec)
    assert result.returncode == 2 and words in result.stderr
