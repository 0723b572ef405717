"""Lightning runs proved by ``zkdv.integrations.lightning.ZKDVCallback``.

The run is ``examples/torch/lightning_lm.py``'s: a ``LightningModule`` (a causal
transformer with dropout that logs its loss), AdamW with a per-step OneCycle schedule
from ``configure_optimizers``, ``accumulate_grad_batches=2``, ``gradient_clip_val`` and
``precision="bf16-mixed"``, all Lightning's own. Honest runs pass every sampled check
and the platform's replay bit for bit; a forged step (clipping skipped, a micro-batch
dropped) is caught; what the callback cannot prove is refused before training.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import zkdv
from tests.torch_replays import replay_rejects, replays_every_step_exactly
from zkdv.records import iter_records
from zkdv.torch._capture import current_capture
from zkdv.verify import verify_transcript

pytest.importorskip("lightning")

from zkdv.integrations.lightning import ZKDVCallback

REPO_ROOT = Path(__file__).resolve().parents[4]
EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))
STEPS = 6


def _example() -> ModuleType:
    path = REPO_ROOT / "examples" / "torch" / "lightning_lm.py"
    spec = importlib.util.spec_from_file_location("zkdv_torch_example_lightning_lm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _example()


def _fit(path: Path, config: zkdv.ZKDVConfig, module: Any = None, **options: Any) -> ZKDVCallback:
    callback = ZKDVCallback(path, config=config)
    torch.manual_seed(0)
    trainer = example.make_trainer([callback], steps=STEPS, **options)
    trainer.fit(module or example.CausalLM(steps=STEPS), example.MarkovData(seed=1))
    return callback


@pytest.mark.slow
def test_a_lightning_run_proves_every_step_and_replays_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    try:
        callback = _fit(tmp_path / "proof", EVERY_STEP, logger=logger)
        tracked = dict(logger.experiment.config)
    finally:
        wandb.finish()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == STEPS, report.summary()
    assert callback.digest == report.digest
    # The trainer's logger (W&B, offline) records the proof.
    assert tracked["zkdv/transcript_digest"] == report.digest
    assert tracked["zkdv/steps"] == STEPS
    steps = [r.data for r in iter_records(tmp_path / "proof") if r.data["t"] == "step"]
    # OneCycle, stepped by Lightning after each optimizer step: one rate per step.
    rates = [step["hp"][0]["lr"] for step in steps]
    assert len(set(rates)) == STEPS and max(rates) <= 3e-3
    # Every micro-batch of a step is committed: two batches of four sequences.
    leaves = report.root["env"]["batch"]["leaves"]
    assert [leaf["shape"] for leaf in leaves] == [[4, 17], [4, 17]]
    replays_every_step_exactly(tmp_path / "proof")


class _Unclipped(example.CausalLM):  # type: ignore[misc, name-defined]
    """A forger's module: clips in the attested step, not in training."""

    def configure_gradient_clipping(self, optimizer: Any, **kwargs: Any) -> None:
        if current_capture() is not None:
            super().configure_gradient_clipping(optimizer, **kwargs)


class _Dropping(example.CausalLM):  # type: ignore[misc, name-defined]
    """A forger's module: its second micro-batch of a step trains on nothing."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if current_capture() is None and batch_idx % 2 == 1:
            return loss * 0
        return loss


@pytest.mark.slow
@pytest.mark.parametrize("forgery", [_Unclipped, _Dropping], ids=["clipping skipped", "dropped"])
def test_a_forged_lightning_step_fails_the_replay(forgery: type, tmp_path: Path) -> None:
    _fit(tmp_path / "proof", NO_CHECKS, forgery(steps=STEPS), gradient_clip_val=0.05)
    assert verify_transcript(tmp_path / "proof").ok  # what a forger files verifies offline
    replay_rejects(tmp_path / "proof", 0)


class _Manual(example.CausalLM):  # type: ignore[misc, name-defined]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss


def test_manual_optimization_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot prove this run yet: manual optimization"):
        _fit(
            tmp_path / "proof",
            NO_CHECKS,
            _Manual(steps=STEPS),
            gradient_clip_val=None,
            accumulate_grad_batches=1,
        )
    assert not (tmp_path / "proof" / "records.cborl").exists()
