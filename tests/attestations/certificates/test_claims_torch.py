"""Claims of a real zkdv.torch run: FLOPs from Torch's FLOP counter, the optimizer and its
options from the root record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from torch import nn
from torch.nn import functional

import zkdv
from attestations.certificates.claims import Limits, evaluate
from attestations.certificates.run_facts import summarize
from zkdv.records import iter_records

pytestmark = pytest.mark.slow
STEPS, ROWS = 3, 4
# Linear(6, 16) then Linear(16, 1) on 4 rows; 2 FLOPs per multiply-add. Forward: both
# layers' products; backward: both weight gradients and the second layer's input
# gradient (the input itself needs none).
FORWARD = 2 * ROWS * 6 * 16 + 2 * ROWS * 16 * 1
BACKWARD = 2 * ROWS * 6 * 16 + 2 * ROWS * 16 * 1 + 2 * ROWS * 16 * 1
FLOPS_PER_STEP = FORWARD + BACKWARD


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch-claims") / "proof"
    torch.manual_seed(0)
    proof = zkdv.torch.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=2,
    )
    proof.program_kind = "torch.export"  # no AOT compile: seconds, not a minute
    proof.start(rolling_window=4, probe_ratio=0.5)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def attested(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        loss = functional.mse_loss(proof.forward(model, inputs)[:, 0], targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(STEPS):
            inputs = torch.randn(ROWS, 6, generator=generator)
            targets = torch.randn(ROWS, generator=generator)
            with proof.transaction(batch=(inputs, targets)):
                loss = functional.mse_loss(model(inputs)[:, 0], targets)
                proof.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        proof.close()
    return path


def test_claims_of_a_torch_run(run: Path) -> None:
    claims = evaluate(summarize(iter_records(run)), Limits(optimizer="torch.optim.AdamW"))
    assert claims.value("steps") == STEPS
    assert claims.value("flops") == STEPS * FLOPS_PER_STEP
    assert claims.details["flops"]["counter"] == "torch.utils.flop_counter"
    optimizer = claims.value("optimizer")
    assert (optimizer["family"], optimizer["matches_declared"]) == ("adamw", True)
    (group,) = optimizer["hyperparameters"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.05)
    assert claims.violations == []
