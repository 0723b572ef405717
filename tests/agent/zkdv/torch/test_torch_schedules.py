"""Every learning-rate and momentum schedule a Torch user reaches for, proved.

Each schedule is created after ``proof.prepare()`` and stepped between transactions, as
users write it; every step is checked by the SDK (``DEBUGCheckEvery(1)``) and then
replayed bit for bit by the platform's prover, which applies each step's committed
options (the step record's ``hp``). The options committed are the ones the optimizer
used: the test reads them back from the transcript and compares them with what the
optimizer's groups held when each step ran.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.optim import lr_scheduler

import zkdv
from provers import torch_replay
from provers.replay import Transcript, windows
from zkdv.records import iter_records
from zkdv.verify import verify_transcript

STEPS = 7
EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))

Schedule = Callable[[Any], Any]


def _sequential(optimizer: Any) -> Any:
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
    return lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[3])


def _chained(optimizer: Any) -> Any:
    return lr_scheduler.ChainedScheduler(
        [
            lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=2),
            lr_scheduler.ExponentialLR(optimizer, gamma=0.9),
        ]
    )


def _hf(name: str) -> Schedule:
    def make(optimizer: Any) -> Any:
        transformers = pytest.importorskip("transformers")
        factory = getattr(transformers, name)
        return factory(optimizer, num_warmup_steps=2, num_training_steps=STEPS)

    return make


class _ByHand:
    """``param_group["lr"] = ...`` written by the training loop itself."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.count = 0

    def step(self) -> None:
        self.count += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.05 / (1 + self.count)
            group["betas"] = (0.9 - 0.01 * self.count, 0.999)


SCHEDULES: dict[str, tuple[str, Schedule]] = {
    # name: (optimizer, make(optimizer) -> scheduler)
    "LambdaLR": ("AdamW", lambda o: lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s))),
    "MultiplicativeLR": ("AdamW", lambda o: lr_scheduler.MultiplicativeLR(o, lambda s: 0.9)),
    "StepLR": ("AdamW", lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "MultiStepLR": ("AdamW", lambda o: lr_scheduler.MultiStepLR(o, milestones=[2, 5])),
    "ConstantLR": ("AdamW", lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3)),
    "LinearLR": ("AdamW", lambda o: lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=4)),
    "ExponentialLR": ("AdamW", lambda o: lr_scheduler.ExponentialLR(o, gamma=0.7)),
    "PolynomialLR": ("AdamW", lambda o: lr_scheduler.PolynomialLR(o, total_iters=6, power=2.0)),
    "CosineAnnealingLR": ("AdamW", lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)),
    "CosineAnnealingWarmRestarts": (
        "AdamW",
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    ),
    # Cycles SGD's momentum too.
    "CyclicLR": ("SGD", lambda o: lr_scheduler.CyclicLR(o, 0.001, 0.05, step_size_up=2)),
    # Cycles Adam's beta1 (betas) with the learning rate.
    "OneCycleLR": ("AdamW", lambda o: lr_scheduler.OneCycleLR(o, 0.05, total_steps=STEPS)),
    "SequentialLR": ("AdamW", _sequential),
    "ChainedScheduler": ("AdamW", _chained),
    "ReduceLROnPlateau": (
        "AdamW",
        lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    ),
    "get_linear_schedule_with_warmup": ("AdamW", _hf("get_linear_schedule_with_warmup")),
    "get_cosine_schedule_with_warmup": ("AdamW", _hf("get_cosine_schedule_with_warmup")),
    "get_constant_schedule_with_warmup": (
        "AdamW",
        lambda o: pytest.importorskip("transformers").get_constant_schedule_with_warmup(o, 2),
    ),
    "by hand": ("AdamW", _ByHand),
}


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() <= 1]
    groups: list[dict[str, Any]] = [
        {"params": weights},
        {"params": biases, "weight_decay": 0.0},
    ]
    if name == "SGD":
        return torch.optim.SGD(groups, lr=0.01, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(groups, lr=0.01)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_schedule_is_committed_per_step_and_replays_exactly(
    schedule: str, tmp_path: Path
) -> None:
    kind, make = SCHEDULES[schedule]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    proof = zkdv.torch.ZKDV(tmp_path / "proof", EVERY_STEP, replay_snapshot_interval=3)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model, optimizer = proof.prepare(model, _optimizer(kind, model))
    scheduler = make(optimizer)

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        loss = functional.cross_entropy(proof.forward(model, inputs), labels)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    used: list[list[dict[str, Any]]] = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = (
            torch.randn(8, 6, generator=generator),
            torch.randint(3, (8,), generator=generator),
        )
        used.append(optimizer.bridge.hyperparameters())
        with proof.transaction(batch=batch):
            loss = train_step(model, optimizer, batch)
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(float(loss))
        else:
            scheduler.step()
    proof.close()

    path = tmp_path / "proof"
    report = verify_transcript(path)
    assert report.ok and report.checks == STEPS, report.summary()
    committed = [r.data["hp"] for r in iter_records(path) if r.data["t"] == "step"]
    assert committed == used
    # The schedule did something: the first group's options are not all the same.
    assert len({repr(step[0]) for step in committed}) > 1, committed
    transcript = Transcript.load(path)
    transition = torch_replay.load_transition(path)
    for first, last in windows(transcript):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_a_replay_applies_the_committed_options(tmp_path: Path) -> None:
    """Edit one step's committed lr (and re-chain): that step no longer replays."""
    from zkdv.records import TranscriptWriter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))
    proof = zkdv.torch.ZKDV(tmp_path / "run", config, replay_snapshot_interval=2)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, labels = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs), labels))
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = (
            torch.randn(8, 6, generator=generator),
            torch.randint(3, (8,), generator=generator),
        )
        with proof.transaction(batch=batch):
            train_step(model, optimizer, batch)
        scheduler.step()
    proof.close()
    assert torch_replay.verify_challenge(tmp_path / "run", 3).ok

    # The same files with step 3's committed lr doubled, the chain recomputed.
    import shutil

    forged = Path(shutil.copytree(tmp_path / "run", tmp_path / "forged"))
    (forged / "records.cborl").unlink()
    writer = TranscriptWriter(forged)
    for record in iter_records(tmp_path / "run"):
        data = dict(record.data)
        data.pop("prev")
        if data["t"] == "step" and data["i"] == 3:
            data["hp"] = [dict(data["hp"][0], lr=2 * data["hp"][0]["lr"])]
        writer.append(data)
    writer.close()
    verdict = torch_replay.verify_challenge(forged, 3)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict.message
    assert str(verdict.message).startswith("step 3:")
