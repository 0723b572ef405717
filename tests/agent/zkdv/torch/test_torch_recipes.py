"""The training loops people run, proved: zero false alarms on honest runs, forgeries caught.

Four recipes, each the loop its users write:

* ``lm``: ``examples/torch/lm.py``, a GPT-style LM with tied weights, SDPA, dropout,
  AdamW with decay / no-decay groups, warmup + cosine ``LambdaLR``, two accumulated
  micro-batches, ``clip_grad_norm_`` and a bf16-autocast forward;
* ``hf``: ``examples/torch/hf_finetune.py``, a Hugging Face GPT-2 from a config (dropout
  0.1, SDPA), ``model(**batch).loss``, frozen lower layers, linear warmup schedule,
  clipping;
* ``bn``: a BatchNorm classifier on scikit-learn's digits with AdamW in two groups, the
  run that raised false alarms at random before the check replayed eager kernels (the
  bias in front of the BatchNorm has a zero true gradient: its update is rounding noise
  that Adam normalises to +-lr, so any difference from training flips its sign);
* ``cnn``: a ``channels_last`` convolutional net with BatchNorm, whose kernels depend on
  the memory format a replay rebuilds its tensors in.

Every honest run checks every step (``DEBUGCheckEvery(1)``) and is then replayed step by
step by the platform's prover, which on the run's own kernels demands the committed
gradient and state bit for bit. Each recipe runs four times here, on one and on two CPU
threads, with a different data seed each time, and ten more times on other CPU kernel
families and thread counts in ``test_torch_cross_kernel.py``, replayed within bounds.
The forgeries the new features open are each caught by the SDK's sampled check and by
the platform's replay (here and, trained on other kernels, there).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from provers import torch_replay
from tests.examples import torch_example
from tests.matrix import FULL
from tests.torch_replays import replay_rejects, replays_every_step_exactly
from zkdv.records import iter_records
from zkdv.torch._capture import current_capture
from zkdv.torch.forgery import hide_learning_rate
from zkdv.verify import verify_transcript

EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))
STEPS = 8


lm = torch_example("lm")


def _bn(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    """BatchNorm + AdamW (two groups) on the UCI digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "weight_decay": 0.0}],
        lr=1e-2,
    )
    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=4)
    proof.start(rolling_window=8, probe_ratio=0.25)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs), targets))
        optimizer.step()
        optimizer.zero_grad()

    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        rows = order[step * 64 : (step + 1) * 64]
        batch = (pixels[rows], labels[rows])
        with proof.transaction(batch=batch):
            train_step(model, optimizer, batch)
    proof.close()


def _hf(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    hf = torch_example("hf_finetune")
    hf.train(path, steps=steps, seed=seed, zkdv_config=zkdv_config, rows=4, width=16)


#: The recipe's model, one block deep: the suite seals it thirty times.
SMALL_LM = lm.LMConfig(width=16, heads=2, layers=1, context=8)
#: Below the small model's gradient norm (about 1 at initialisation): clipping acts.
MAX_GRAD_NORM = 0.25


def _lm(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    lm.train(
        path,
        steps=steps,
        seed=seed,
        config=SMALL_LM,
        zkdv_config=zkdv_config,
        rows=4,
        max_grad_norm=MAX_GRAD_NORM,
    )


def _cnn(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    """A channels_last convolutional net with BatchNorm, as vision training runs it.

    Convolutions pick their kernel by memory format, so a replay that rebuilt weights or
    images contiguous would compute something else than training did.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # a bias in front of BatchNorm: rounding noise
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=4)
    proof.start(rolling_window=8, probe_ratio=0.25)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: Any) -> None:
        images, labels = batch
        proof.backward(functional.cross_entropy(proof.forward(model, images), labels))
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        images = torch.randn(8, 3, 12, 12, generator=generator)
        labels = torch.randint(4, (8,), generator=generator)
        batch = (images.to(memory_format=torch.channels_last), labels)
        with proof.transaction(batch=batch):
            train_step(model, optimizer, batch)
    proof.close()


RECIPES: dict[str, Callable[..., None]] = {"lm": _lm, "hf": _hf, "bn": _bn, "cnn": _cnn}


def _hf_trainer(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    """``examples/torch/hf_trainer.py``'s Trainer, proved by zkdv.integrations."""
    from zkdv.integrations.transformers import prove

    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as output:
        trainer = torch_example("hf_trainer").make_trainer(output, seed=seed, max_steps=steps)
        prove(trainer, path, config=zkdv_config)
        trainer.train()


def _lightning(path: Path, *, seed: int, zkdv_config: zkdv.ZKDVConfig, steps: int = STEPS) -> None:
    """``examples/torch/lightning_lm.py``'s run, proved by zkdv.integrations."""
    from zkdv.integrations.lightning import ZKDVCallback

    example = torch_example("lightning_lm")
    callback = ZKDVCallback(path, config=zkdv_config)
    torch.manual_seed(seed)
    example.make_trainer([callback], steps=steps).fit(
        example.CausalLM(steps=steps), example.MarkovData(seed=seed + 1)
    )


#: The framework integrations' runs, trained on other kernels by bench/cross_hardware.py
#: (tests/agent/zkdv/torch/test_integration_*.py run them once each here).
FRAMEWORK_RECIPES: dict[str, Callable[..., None]] = {
    "hf-trainer": _hf_trainer,
    "lightning": _lightning,
}


#: (recipe, run, threads): every recipe once, on one thread and two in turn; under
#: ZKDV_TEST_MATRIX=full two seeds of each on both (tests/matrix.py).
HONEST = (
    [(r, run, t) for r in sorted(RECIPES) for run in range(2) for t in (1, 2)]
    if FULL
    else [(r, 0, 1 + i % 2) for i, r in enumerate(sorted(RECIPES))]
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "run", "threads"), HONEST, ids=["-".join(map(str, c)) for c in HONEST]
)
def test_honest_runs_pass_every_check_and_replay(
    recipe: str, run: int, threads: int, tmp_path: Path
) -> None:
    if recipe == "hf":
        pytest.importorskip("transformers")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        RECIPES[recipe](tmp_path / "proof", seed=10 * run + threads, zkdv_config=EVERY_STEP)
    finally:
        torch.set_num_threads(previous)
    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == STEPS, report.summary()
    assert report.root["env"]["threads"] == threads
    # The platform replays on the run's recorded thread count, whatever its own is.
    replays_every_step_exactly(tmp_path / "proof")


def test_the_lm_recipe_commits_what_its_schedule_and_dropout_need(tmp_path: Path) -> None:
    _lm(tmp_path / "proof", seed=0, zkdv_config=EVERY_STEP)
    records = [record.data for record in iter_records(tmp_path / "proof")]
    env = records[0]["env"]
    assert env["rng"]["derivation"] == "zkdv-torch-rng-v1"
    assert env["optimizer"]["dynamic"] == [["betas", "eps", "lr", "weight_decay"]] * 2
    steps = [record for record in records if record["t"] == "step"]
    rates = [step["hp"][0]["lr"] for step in steps]
    warmup = lm.warmup_cosine(max(1, STEPS // 10), STEPS)
    assert rates == pytest.approx([3e-3 * warmup(index) for index in range(STEPS)], rel=1e-12)
    assert [step["hp"][1]["weight_decay"] for step in steps] == [0.0] * STEPS
    # One Parameter for the tied embedding and head: committed once.
    names = [leaf["path"] for leaf in records[0]["schema"]["params"]]
    assert "tokens.weight" in names and "head.weight" not in names


# --- forgeries ----------------------------------------------------------------------------
# Each trains the LM recipe's model with one thing changed in the eager step, while the
# attested step (the program a check and the platform replay) stays the honest one.


def _forged_lm(path: Path, forgery: str, zkdv_config: zkdv.ZKDVConfig) -> None:
    config = SMALL_LM
    torch.manual_seed(0)
    model = lm.TinyLM(config)
    optimizer = torch.optim.AdamW(lm.parameter_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=4)
    proof.start(rolling_window=8, probe_ratio=0.05)
    model, optimizer = proof.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lm.warmup_cosine(2, STEPS))

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = proof.forward(model, tokens[:, :-1])
        return functional.cross_entropy(
            logits.float().reshape(-1, config.vocab), tokens[:, 1:].reshape(-1)
        )

    def step(model: Any, optimizer: Any, batch: torch.Tensor, *, clip: bool = True) -> None:
        micro_batches = batch.unbind(0)
        if forgery == "dropped micro-batch" and current_capture() is None:
            micro_batches = micro_batches[:1]
        for micro in micro_batches:
            proof.backward(loss_of(micro) / batch.shape[0])
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        if forgery == "scaled gradient" and current_capture() is None:
            with torch.no_grad():
                for parameter in model.parameters():
                    if parameter.grad is not None:
                        parameter.grad.mul_(1.01)
        optimizer.step()
        optimizer.zero_grad()

    proof.attest(step)
    if forgery == "hidden learning rate":
        hide_learning_rate(optimizer, 2.0, group=0)
    data = lm.token_batches(config, steps=STEPS, micro_batches=2, rows=4, seed=1)
    try:
        for index, batch in enumerate(data):
            with proof.transaction(batch=batch):
                if forgery == "own dropout seed":
                    torch.manual_seed(1000 + index)
                if forgery == "swapped batch":
                    batch.copy_(batch.roll(1, dims=-1))  # after the transaction committed it
                step(model, optimizer, batch, clip=forgery != "clipping skipped")
            schedule.step()
            if forgery == "parameter nudge" and index == 0:
                proof.join()  # the nudge lands after step 0's commitment, before step 1
                with torch.no_grad():  # every coordinate: whichever a check samples moved
                    for parameter in model.parameters():
                        parameter.add_(1e-3)
    finally:
        proof.close()


def _forged_finetune(path: Path, forgery: str, zkdv_config: zkdv.ZKDVConfig) -> None:
    """Almost every coordinate frozen (a large embedding), and changed during each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Flatten(), nn.Linear(4 * 64, 3))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=4)
    proof.start(rolling_window=4, probe_ratio=0.25)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def step(model: Any, optimizer: Any, batch: Any) -> None:
        ids, labels = batch
        proof.backward(functional.cross_entropy(proof.forward(model, ids), labels))
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(STEPS):
            batch = (torch.randint(4096, (8, 4), generator=generator), torch.randint(3, (8,)))
            with proof.transaction(batch=batch):
                step(model, optimizer, batch)
                with torch.no_grad():  # the forgery: the frozen table moves too
                    model[0].weight.mul_(1.01)
    finally:
        proof.close()


FORGERIES: dict[str, Callable[[Path, str, zkdv.ZKDVConfig], None]] = {
    "clipping skipped": _forged_lm,
    "dropped micro-batch": _forged_lm,
    "hidden learning rate": _forged_lm,
    "own dropout seed": _forged_lm,
    "frozen parameter changed": _forged_finetune,
    # Committed (and applied) gradient 1 % larger than the program's: a scaling lies all
    # along the gradient, where honest rounding (even bfloat16's) leaves almost nothing.
    "scaled gradient": _forged_lm,
    "swapped batch": _forged_lm,
    "parameter nudge": _forged_lm,
}
#: The step at which each forgery shows: every one starts at step 0 but the nudge, which
#: changes the parameters between steps 0 and 1.
FORGED_AT = {name: 1 if name == "parameter nudge" else 0 for name in FORGERIES}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forgeries_fail_the_sampled_check(forgery: str, tmp_path: Path) -> None:
    # The first check fails (the frozen table: the first check that samples one of its
    # coordinates, 99.7 % of them).
    with pytest.raises(zkdv.ZKDVPoisonedError, match=r"sampled check of step \d+ failed"):
        FORGERIES[forgery](tmp_path / "proof", forgery, EVERY_STEP)
    report = verify_transcript(tmp_path / "proof")
    # A nudge every probe sees breaks their continuity, a rule that comes first.
    expected = "probe_discontinuity" if forgery == "parameter nudge" else "failed_check"
    assert (report.ok, report.reason) == (False, expected)


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forgeries_fail_the_platform_replay(forgery: str, tmp_path: Path) -> None:
    # No SDK checks: the transcript is what a forger would file, and it verifies.
    FORGERIES[forgery](tmp_path / "proof", forgery, NO_CHECKS)
    path = tmp_path / "proof"
    assert_caught(path, forgery)


def assert_caught(path: Path, forgery: str) -> None:
    """The platform's replay of the forged step's window rejects the run at that step.

    A forger who keeps the probes honest (a nudge the probes see) is rejected by the
    offline verifier already; the replay is what catches everything else.
    """
    report = verify_transcript(path)
    step = FORGED_AT[forgery]
    if not report.ok:
        assert forgery == "parameter nudge" and report.reason == "probe_discontinuity"
        verdict = torch_replay.verify_challenge(path, 0, through=step)
        assert verdict.reason == "invalid_transcript", verdict.message
        return
    replay_rejects(path, step)
