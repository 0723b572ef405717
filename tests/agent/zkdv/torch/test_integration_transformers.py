"""Hugging Face ``Trainer`` runs proved by ``zkdv.integrations.transformers.prove``.

The runs are ``examples/torch/hf_trainer.py``'s and ``hf_lora.py``'s: a GPT-2 (or a
LoRA-adapted Llama) from a small config, a word tokenizer and the language-modelling
collator, AdamW with a linear warmup schedule, two accumulated micro-batches, clipping,
bf16 autocast and dropout, all the Trainer's own. Honest runs pass every sampled check
and the platform's replay, bit for bit; what a forger changes in the Trainer's step (a
micro-batch dropped, clipping skipped, an adapter nudged, a frozen base weight moved)
is caught; setups the integration cannot prove are refused before training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
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

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import transformers

from zkdv.integrations.transformers import prove

REPO_ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = REPO_ROOT / "examples" / "torch"
EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))
STEPS = 6


def _example(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLES))  # hf_lora imports hf_trainer, as a script would
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hf_trainer = _example("hf_trainer")


def _steps(path: Path) -> list[dict[str, Any]]:
    return [record.data for record in iter_records(path) if record.data["t"] == "step"]


@pytest.mark.slow
def test_a_trainer_run_proves_every_step_and_replays_exactly(tmp_path: Path) -> None:
    trainer = hf_trainer.make_trainer(
        tmp_path / "out", max_steps=STEPS, save_strategy="steps", save_steps=3
    )
    proof = prove(trainer, tmp_path / "proof", config=EVERY_STEP)
    trainer.train()

    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == STEPS, report.summary()
    assert proof.steps == STEPS and proof.digest == report.digest
    # The Trainer's own schedule (linear, two warmup steps) is what each step committed.
    rates = [step["hp"][0]["lr"] for step in _steps(tmp_path / "proof")]
    schedule = [1e-3 * min(i / 2, (STEPS - i) / (STEPS - 2)) for i in range(STEPS)]
    assert rates == pytest.approx(schedule, rel=1e-9)
    # Its two parameter groups (decay, no decay) and AdamW: the canonical update.
    env = report.root["env"]
    assert env["optimizer"]["canonical"] == "zkdv-torch-canonical-v1"
    assert [group["weight_decay"] for group in _steps(tmp_path / "proof")[0]["hp"]] == [0.01, 0.0]
    assert env["rng"]["derivation"] == "zkdv-torch-rng-v1"  # dropout masks committed
    replays_every_step_exactly(tmp_path / "proof")
    # The Trainer's own outputs keep working: its checkpoints (optimizer and scheduler
    # state included) and save_model.
    for step in (3, 6):
        checkpoint = tmp_path / "out" / f"checkpoint-{step}"
        assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "scheduler.pt").exists()
        state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        assert len(state["param_groups"]) == 2 and state["state"], checkpoint
    trainer.save_model(str(tmp_path / "model"))
    assert (tmp_path / "model" / "model.safetensors").exists()


class _DroppingTrainer(transformers.Trainer):
    """A forger's Trainer: trains on the first micro-batch of each step only."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if current_capture() is None:  # the eager step; the attested one is honest
            self.micro = getattr(self, "micro", -1) + 1
            if self.micro % 2 == 1:
                return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)


class _UnclippedTrainer(transformers.Trainer):
    """A forger's Trainer: clips in the attested step, not in training."""

    def _clip_grad_norm(self, model: Any) -> Any:
        if current_capture() is None:
            return torch.zeros(())
        return super()._clip_grad_norm(model)


#: max_grad_norm below the small model's gradient norm (about 1): clipping acts.
FORGED = {"max_steps": 2, "max_grad_norm": 0.1}


@pytest.mark.slow
def test_a_dropped_micro_batch_fails_the_sampled_check(tmp_path: Path) -> None:
    # A sampled check opens one parameter and one optimizer-state coordinate of the step,
    # drawn from the transcript (its clock included), so whether a draw lands on a
    # coordinate the dropped micro-batch moved is chance: in one CI run neither of two
    # steps' draws did. Six forged steps give the forgery six draws.
    forged = {**FORGED, "max_steps": 6}
    trainer = hf_trainer.make_trainer(tmp_path / "out", trainer_class=_DroppingTrainer, **forged)
    prove(trainer, tmp_path / "proof", config=EVERY_STEP)
    with pytest.raises(zkdv.ZKDVPoisonedError, match=r"sampled check of step \d+ failed"):
        trainer.train()
    report = verify_transcript(tmp_path / "proof")
    assert (report.ok, report.reason) == (False, "failed_check")


@pytest.mark.slow
def test_skipped_clipping_fails_the_platform_replay(tmp_path: Path) -> None:
    # No SDK checks: the transcript is what a forger files, and it verifies offline.
    trainer = hf_trainer.make_trainer(tmp_path / "out", trainer_class=_UnclippedTrainer, **FORGED)
    prove(trainer, tmp_path / "proof", config=NO_CHECKS)
    trainer.train()
    assert verify_transcript(tmp_path / "proof").ok
    replay_rejects(tmp_path / "proof", 0)


def test_a_step_with_fewer_micro_batches_is_refused_with_the_fix(tmp_path: Path) -> None:
    # 5 batches per epoch, 2 per step: the third step would accumulate one.
    trainer = hf_trainer.make_trainer(
        tmp_path / "out", rows=20, max_steps=4, dataloader_drop_last=False, logging_steps=100
    )
    prove(trainer, tmp_path / "proof", config=NO_CHECKS)
    with pytest.raises(RuntimeError, match=r"optimizer step 2 accumulates 1 micro-batches, .* 2;"):
        trainer.train()
    assert [step["i"] for step in _steps(tmp_path / "proof")] == [0, 1]


def test_setups_it_cannot_prove_are_refused_before_training(tmp_path: Path) -> None:
    trainer = hf_trainer.make_trainer(tmp_path / "out", max_steps=2, torch_compile=True)
    with pytest.raises(ValueError, match=r"cannot prove this Trainer run yet: torch_compile"):
        prove(trainer, tmp_path / "proof")
    assert not (tmp_path / "proof" / "records.cborl").exists()


# --- PEFT ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_lora() -> ModuleType:
    pytest.importorskip("peft")
    return _example("hf_lora")


def _lora_run(module: ModuleType, path: Path, config: zkdv.ZKDVConfig, **options: Any) -> Any:
    trainer = module.make_lora_trainer(path.parent / "out", max_steps=4, **options)
    prove(trainer, path, config=config)
    return trainer


@pytest.mark.slow
def test_a_lora_fine_tune_trains_the_adapters_and_keeps_the_base(
    hf_lora: ModuleType, tmp_path: Path
) -> None:
    trainer = _lora_run(hf_lora, tmp_path / "proof", EVERY_STEP, learning_rate=3e-3)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == 4, report.summary()
    names = [leaf["path"] for leaf in report.root["schema"]["params"]]
    adapters = [name for name in names if "lora_" in name]
    assert adapters and len(adapters) < len(names)  # every weight committed, base included
    for name, parameter in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name
    replays_every_step_exactly(tmp_path / "proof")


class _NudgeAdapters(transformers.TrainerCallback):
    """A forger's callback: moves the adapters between two optimizer steps."""

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "lora_B" in name:
                        parameter.add_(1e-3)


class _MoveTheBase(transformers.TrainerCallback):
    """A forger's callback: changes a frozen base weight inside the first step."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            model = kwargs["model"]
            with torch.no_grad():
                model.base_model.model.lm_head.weight.mul_(1.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("forgery", "callback", "step"),
    [("adapter nudged", _NudgeAdapters, 1), ("frozen base changed", _MoveTheBase, 0)],
)
def test_a_forged_lora_run_is_rejected(
    hf_lora: ModuleType, forgery: str, callback: type, step: int, tmp_path: Path
) -> None:
    trainer = _lora_run(hf_lora, tmp_path / "proof", NO_CHECKS, learning_rate=3e-3)
    # Before prove()'s own callback would be too late for the base: it closes the step.
    trainer.callback_handler.callbacks.insert(0, callback())
    trainer.train()
    report = verify_transcript(tmp_path / "proof")
    if not report.ok:  # the nudge breaks the probes' continuity: rejected offline already
        assert forgery == "adapter nudged" and report.reason == "probe_discontinuity"
        return
    replay_rejects(tmp_path / "proof", step, earliest=0)


# --- accelerate launch --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(900)  # accelerate launch has 600 s
def test_the_trainer_script_proves_under_accelerate_launch_with_two_processes(
    tmp_path: Path,
) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1"),
        *("--main_process_port", str(_free_port())),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        str(EXAMPLES / "hf_trainer.py"),
        *("--proof-dir", str(tmp_path / "proof"), "--steps", "4", "--max-grad-norm", "0"),
        *("--check-every", "1"),
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == 4, report.summary()
    assert report.root["env"]["world_size"] == 2
    assert summary["transcript_digest"] == report.digest
    replays_every_step_exactly(tmp_path / "proof")
