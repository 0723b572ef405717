"""ZKDV's cost on a Hugging Face ``Trainer`` run: the Trainer's step with and without a proof.

    python bench/torch_overhead.py --recipe hf-trainer [--rounds 3] [--steps 12] [--no-autocast]
    python bench/hf_trainer_overhead.py [--rounds 3] [--steps 12] [--no-autocast]   # the same

The run is ``examples/torch/hf_trainer.py``'s Trainer with a larger GPT-2 (2 layers,
width 128, context 128, a 2,048-word vocabulary): AdamW in decay / no-decay groups, a
linear warmup schedule, two accumulated micro-batches of 8 sequences, ``max_grad_norm``,
``bf16=True`` (``--no-autocast``: float32, for a CPU without native bfloat16, where bf16
runs about 10 times slower and hides the overhead in noise) and dropout. Three variants, each a fresh Trainer from the same weights,
run one after another in every round (so machine noise hits all alike): the plain
Trainer, ``prove(trainer, ...)`` with the default policy (p = 0.01, a snapshot every 12
steps), and with checks off (p = 0). A variant's time per step runs from the end of its
first optimizer step (which seals the program, reported apart) to the end of
``trainer.train()``, which for a proof includes closing it (every commitment and check
done). The median over rounds is reported, beside the check-free floor of
``bench/_floor.py`` (hash the state, copy it every 12th step) measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
import transformers

import zkdv
from zkdv.integrations.transformers import prove

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "torch"))
from _floor import floor_lines
from hf_trainer import make_trainer

CONTEXT = 128
POLICIES = {
    "plain": None,
    "zkdv": zkdv.SamplingPolicy(),
    "zkdv p=0": zkdv.SamplingPolicy(update_check_probability=0.0),
}


def _model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=2048, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4
    )
    return transformers.GPT2LMHeadModel(config)


class _Clock(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.first_step_end: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first_step_end is None:
            self.first_step_end = time.perf_counter()


def _one(
    label: str, steps: int, root: Path, weights: dict[str, torch.Tensor], *, bf16: bool
) -> dict[str, Any]:
    model = _model()
    model.load_state_dict(weights)
    trainer = make_trainer(
        root / label,
        model=model,
        rows=16 * (steps + 1),
        max_steps=steps,
        per_device_train_batch_size=8,
        logging_steps=10**6,
        bf16=bf16,
    )
    trainer.train_dataset = _long_rows(len(trainer.train_dataset))
    clock = _Clock()
    trainer.add_callback(clock)
    proof = None
    policy = POLICIES[label]
    if policy is not None:
        config = zkdv.ZKDVConfig(sampling_policy=policy)
        proof = prove(trainer, root / label / "proof", config=config)
    start = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    assert clock.first_step_end is not None
    result = {
        "step_ms": (end - clock.first_step_end) / (steps - 1) * 1e3,
        "first_ms": (clock.first_step_end - start) * 1e3,
        "checks": 0,
        "trainer": trainer,
    }
    if proof is not None:
        from zkdv.verify import verify_transcript

        result["checks"] = verify_transcript(proof.path).checks
    return result


def _long_rows(rows: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 2048, (rows, CONTEXT), generator=generator).tolist()
    return [{"input_ids": row, "attention_mask": [1] * CONTEXT} for row in ids]


def _state_bytes(trainer: Any) -> np.ndarray:
    leaves = [p.detach() for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        leaves.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return np.concatenate([t.cpu().reshape(-1).view(torch.uint8).numpy() for t in leaves])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-autocast", dest="autocast", action="store_false")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__} "
        f"({torch.get_num_threads()} threads, {os.cpu_count()} cpus); {args.rounds} rounds x "
        f"{args.steps} steps per variant; {'bf16 autocast' if args.autocast else 'float32'}"
    )
    weights = {name: value.clone() for name, value in _model().state_dict().items()}
    times: dict[str, list[float]] = {label: [] for label in POLICIES}
    firsts: dict[str, list[float]] = {label: [] for label in POLICIES}
    checks: dict[str, int] = dict.fromkeys(POLICIES, 0)
    last: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zkdv-bench-trainer-") as root:
        for round_ in range(args.rounds):
            for label in POLICIES:
                directory = Path(root) / f"round-{round_}"
                result = _one(label, args.steps, directory, weights, bf16=args.autocast)
                times[label].append(result["step_ms"])
                firsts[label].append(result["first_ms"])
                checks[label] += result["checks"]
                last[label] = result["trainer"]
        flat = _state_bytes(last["plain"])
        gradient_bytes = sum(
            p.numel() * p.element_size()
            for p in last["plain"].model.parameters()
            if p.requires_grad
        )
    hashes = []
    for _ in range(5):
        start = time.perf_counter()
        blake3.blake3(memoryview(flat), max_threads=blake3.blake3.AUTO).digest()
        hashes.append(time.perf_counter() - start)
    ms = {label: statistics.median(values) for label, values in times.items()}
    plain = ms["plain"]
    print(
        f"hf-trainer: {flat.nbytes / 2**20:.1f} MiB of state; load average {os.getloadavg()[0]:.1f}"
    )
    for label in POLICIES:
        line = f"  {label:9s} {ms[label]:8.1f} ms/step"
        if label != "plain":
            first = statistics.median(firsts[label]) - statistics.median(firsts["plain"])
            line += (
                f"  ratio {ms[label] / plain:.3f}  added {ms[label] - plain:+.1f} ms/step; "
                f"{checks[label]} sampled checks in {args.rounds * args.steps} steps; "
                f"first step +{first / 1e3:.1f} s (sealing)"
            )
        print(line)
    print(f"  default policy - p=0: {ms['zkdv'] - ms['zkdv p=0']:+.1f} ms/step")
    for line in floor_lines(
        flat,
        plain_ms=plain,
        hash_ms=min(hashes) * 1e3,
        added_ms=ms["zkdv"] - plain,
        gradient_bytes=gradient_bytes,  # a Torch run commits its gradient
    ):
        print(line)


if __name__ == "__main__":
    main()
