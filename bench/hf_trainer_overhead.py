"""ZKDV's cost on a Hugging Face ``Trainer`` run: the Trainer's step with and without a proof.

    python bench/torch_overhead.py --recipe hf-trainer [--rounds 3] [--steps 24] [--no-autocast]
    python bench/hf_trainer_overhead.py [--rounds 3] [--steps 24] [--no-autocast]   # the same

The run is ``examples/torch/hf_trainer.py``'s Trainer with a larger GPT-2 (2 layers,
width 128, context 128, a 2,048-word vocabulary): AdamW in decay / no-decay groups, a
linear warmup schedule, two accumulated micro-batches of 8 sequences, ``max_grad_norm``,
``bf16=True`` (``--no-autocast``: float32, for a CPU without native bfloat16, where bf16
runs about 10 times slower and hides the overhead in noise) and dropout. Three variants,
each a fresh Trainer from the same weights, run one after another in every round (so
machine noise hits all alike), in an order that rotates every round: the plain Trainer,
``prove(trainer, ...)`` with the default policy (p = 0.01, a snapshot every 12 steps),
and with checks off (p = 0).

A variant's step time is the median of the intervals between consecutive optimizer
steps' ends (the ``on_step_end`` callback) from its second step's end on: the first step
seals the program (its time is reported apart) and its commitment opens the transcript
while the second step trains. A step's commitment overlaps the next step, so its cost
shows in the interval; a rare step that runs a sampled check does not move the median,
which is the cost of a step without a check (the checks drawn are printed). The end of
``trainer.train()`` (closing the proof, the Trainer's own wrap-up) is not timed.

Per round, each proof's step time over the plain one's in the same round is its paired
ratio. The medians over rounds are reported, with the CPU time of ZKDV's own threads by
stage, the training thread's and the page faults per step (``bench/_threads.py``), and
the check-free floor of ``bench/_floor.py`` (hash the state, copy it every 12th step)
measured in the same run.
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
from _threads import CpuBreakdown
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
    """Each optimizer step's end, and the CPU time of the steady steps.

    The first step seals the program and its commitment opens the transcript (the
    initial state, the probe matrices), which runs while the second step trains: the
    CPU block runs from the second step's end to the last one's, while ZKDV's threads
    are still alive (``trainer.train()`` closes the proof after its last step), and in
    the steady pipeline it holds as many steps' commitments as steps.
    """

    def __init__(self, steps: int, cpu: CpuBreakdown) -> None:
        self.steps = steps
        self.ends: list[float] = []
        self._cpu = cpu
        self._block: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) == 2:
            self._block = self._cpu.block(self.steps - 2)
            self._block.__enter__()
        elif len(self.ends) == self.steps and self._block is not None:
            self._block.__exit__(None, None, None)
            self._block = None


def _one(
    label: str,
    steps: int,
    root: Path,
    weights: dict[str, torch.Tensor],
    cpu: CpuBreakdown,
    *,
    bf16: bool,
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
    # The run's closing metrics would print among the report's lines.
    trainer.remove_callback(transformers.PrinterCallback)
    clock = _Clock(steps, cpu)
    trainer.add_callback(clock)
    proof = None
    policy = POLICIES[label]
    if policy is not None:
        config = zkdv.ZKDVConfig(sampling_policy=policy)
        proof = prove(trainer, root / label / "proof", config=config)
    start = time.perf_counter()
    trainer.train()
    assert len(clock.ends) == steps, f"{label}: {len(clock.ends)} of {steps} steps ran"
    result = {
        # From the second step's end, as the CPU block (see _Clock).
        "step_ms": statistics.median(np.diff(clock.ends[1:])) * 1e3,
        "first_ms": (clock.ends[0] - start) * 1e3,
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
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--no-autocast", dest="autocast", action="store_false")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3: the step time is timed from the second step")
    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__} "
        f"({torch.get_num_threads()} threads, {os.cpu_count()} cpus); {args.rounds} rounds x "
        f"{args.steps} steps per variant; {'bf16 autocast' if args.autocast else 'float32'}"
    )
    weights = {name: value.clone() for name, value in _model().state_dict().items()}
    labels = list(POLICIES)
    times: dict[str, list[float]] = {label: [] for label in labels}
    firsts: dict[str, list[float]] = {label: [] for label in labels}
    checks: dict[str, int] = dict.fromkeys(labels, 0)
    cpu = {label: CpuBreakdown() for label in labels}
    last: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zkdv-bench-trainer-") as root:
        for round_ in range(args.rounds):
            # The order rotates, so that no variant always runs after the same other one.
            turn = round_ % len(labels)
            for label in labels[turn:] + labels[:turn]:
                directory = Path(root) / f"round-{round_}"
                result = _one(label, args.steps, directory, weights, cpu[label], bf16=args.autocast)
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
    for label in labels:
        line = f"  {label:9s} {ms[label]:8.1f} ms/step"
        if label != "plain":
            first = statistics.median(firsts[label]) - statistics.median(firsts["plain"])
            line += (
                f"  ratio {ms[label] / plain:.3f}  added {ms[label] - plain:+.1f} ms/step; "
                f"{checks[label]} sampled checks in {args.rounds * args.steps} steps; "
                f"first step +{first / 1e3:.1f} s (sealing)"
            )
        print(line)
    for label in labels[1:]:
        ratios = [z / p for z, p in zip(times[label], times["plain"], strict=True)]
        print(
            f"  {label} / plain, same round: median step-time ratio "
            f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)})"
        )
    print(f"  default policy - p=0: {ms['zkdv'] - ms['zkdv p=0']:+.1f} ms/step")
    for label in labels:
        baseline = None if label == "plain" else ("plain", cpu["plain"])
        print(cpu[label].line(label, baseline))
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
