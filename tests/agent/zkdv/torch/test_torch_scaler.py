"""fp16 autocast with a GradScaler: loss scaling, overflow skips and scale updates, proved.

Runs on the CPU (``torch.amp.GradScaler("cpu")`` and fp16 autocast), where the scaler
runs the same kernels (``_amp_foreach_non_finite_check_and_unscale_``,
``_amp_update_scale_``) it runs on CUDA. One batch is scaled up so that its gradients
overflow in fp16: the scaler skips that optimizer step and halves its scale, and the
step is still committed, with the parameters unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from provers import torch_replay
from provers.replay import Transcript, windows
from zkdv.records import iter_records
from zkdv.verify import verify_transcript

STEPS = 7
OVERFLOW = 2  # the step whose gradients overflow fp16
EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))


def _train(path: Path, config: zkdv.ZKDVConfig, *, forge_scale: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    proof = zkdv.torch.ZKDV(path, config, replay_snapshot_interval=3)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model, optimizer, scaler = proof.prepare(model, optimizer, scaler)

    def step(model: nn.Module, optimizer: Any, batch: Any, *, new_scale: Any = None) -> None:
        inputs, labels = batch
        with torch.autocast("cpu", dtype=torch.float16):
            logits = proof.forward(model, inputs)
        proof.backward(scaler.scale(functional.cross_entropy(logits.float(), labels)))
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update(new_scale)
        optimizer.zero_grad()

    proof.attest(step)
    scales = []
    generator = torch.Generator().manual_seed(1)
    try:
        for index in range(STEPS):
            inputs = torch.randn(16, 8, generator=generator) * (1e4 if index == OVERFLOW else 1)
            batch = (inputs, torch.randint(4, (16,), generator=generator))
            with proof.transaction(batch=batch):
                step(
                    model,
                    optimizer,
                    batch,
                    new_scale=1024.0 if forge_scale and index == 4 else None,
                )
            scales.append(scaler.get_scale())
    finally:
        proof.close()
    return scales


def test_an_honest_fp16_run_with_an_overflow_is_checked_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "proof"
    scales = _train(path, EVERY_STEP)
    # Growth every two clean steps, a halving at the overflow.
    assert scales == [2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17, 2.0**17, 2.0**18]
    report = verify_transcript(path)
    assert report.ok and report.checks == STEPS, report.summary()
    root = report.root
    assert root["env"]["grad_scaler"] == {
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
    }
    paths = [leaf["path"] for leaf in root["schema"]["opt_state"]]
    assert paths[-2:] == ["grad_scaler.growth_tracker", "grad_scaler.scale"]
    steps = [r.data for r in iter_records(path) if r.data["t"] == "step"]
    # The skipped step committed the parameters unchanged.
    assert steps[OVERFLOW]["post"]["p"] == steps[OVERFLOW - 1]["post"]["p"]
    assert steps[OVERFLOW]["post"]["o"] != steps[OVERFLOW - 1]["post"]["o"]  # the scale
    transition = torch_replay.load_transition(path)
    for first, last in windows(Transcript.load(path)):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_a_scale_set_by_hand_in_the_eager_step_fails_the_replay(tmp_path: Path) -> None:
    # The attested step updates the scale by the scaler's rule; the eager step sets it.
    path = tmp_path / "proof"
    _train(path, NO_CHECKS, forge_scale=True)
    assert verify_transcript(path).ok
    verdict = torch_replay.verify_challenge(path, 4)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict.message
    assert str(verdict.message).startswith("step 4:")


def test_a_disabled_scaler_passes_through(tmp_path: Path) -> None:
    proof = zkdv.torch.ZKDV(tmp_path / "proof")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert proof.prepare(scaler) is scaler


def test_one_scaler_per_proof(tmp_path: Path) -> None:
    proof = zkdv.torch.ZKDV(tmp_path / "proof")
    proof.prepare(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="one GradScaler per proof"):
        proof.prepare(torch.amp.GradScaler("cpu"))
