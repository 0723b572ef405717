"""ZKDV's Torch overhead: a plain eager step versus the ZKDV transaction, side by side.

    python bench/torch_overhead.py [--quick] [--rounds 3] [--steps 12] [--only lm|mlp]
                                   [--recipe lm|hf-trainer] [--no-autocast] [--stat min]
                                   [--checked]
                                   [--program torch.export|aot-inductor] [--chunk-bytes N]

Two workloads, each trained with ``torch.optim.Adam`` in eager mode:

* ``lm``: a small causal transformer language model, 16 x 512 = 8,192 tokens per step
  (target: step-time ratio <= 1.02);
* ``mlp``: a 10M-parameter MLP at batch 64, the state-heavy worst case (target: the time
  ZKDV adds per step <= 1.2 x what raw ``blake3`` with all threads needs to hash the same
  state bytes once, measured here; the plain ratio is printed too).

``--recipe lm`` runs the LM recipe of ``examples/torch/lm.py`` instead, the loop LLM
teams write: tied embedding and head, dropout, AdamW with decay / no-decay groups, a
warmup + cosine ``LambdaLR`` stepped after every step, two accumulated micro-batches of
8 x 256 tokens, ``clip_grad_norm_(1.0)`` and a bf16-autocast forward (4,096 predicted
tokens per step).

For each workload the same step runs as plain eager code, inside ``proof.transaction``
with the default policy (p = 0.01, N = 12), inside ``proof.transaction`` with checks off
(p = 0: commitments, probes, snapshots and files only), and with ``--checked`` also
under ``SamplingPolicy.DEBUGCheckEvery(1)``, in interleaved blocks of ``--steps`` steps
so that machine noise hits all alike; the order of the variants rotates every round, so
none always runs right after the same other one. For every variant the time the
training thread spent waiting inside ZKDV (admission, the mutation barrier, a free
snapshot slot) is printed, and the default policy's block time minus p = 0's in the
same round: on a step without a check the two do the same work. A sampled check replays on average 6.5 steps
(the challenged one and half a snapshot window before it) and, under the default
``UNCHECKED`` overlap policy, training waits for it: with p = 0.01 that is about
0.01 x 6.5 = 6.5 % of the forward-backward compute on average, concentrated in the
rare checked steps, so a short run's default-policy number depends on how many checks
its steps happened to draw (printed). A proof's block ends with
``proof.join()``, so its commitments (and checks) are inside the timing. Each variant has
its own identical copy of the model and optimizer. The median block time per step is
reported (``--stat min``: the fastest block, which estimates the unloaded time on a
machine shared with other work), and per ZKDV variant the median over rounds of its
block's time over the eager block's in the same round: the paired ratio, the steadier of
the two on a machine whose speed drifts by more than the overhead measured. The one-time sealing cost (tracing and exporting the attested step, plus
the AOT Inductor compile with ``--program aot-inductor``, paid by the first transaction)
is reported separately and is not in the step times.

On a shared machine wall-clock times swing with other processes' load (printed), so the
process CPU time per step is reported too: the work ZKDV adds, whoever else runs. Per
variant, the CPU time of ZKDV's own threads by stage and of the training thread, and the
minor page faults per step (``bench/_threads.py``), say where that work goes with much
less noise than the ratio.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from _floor import floor_lines  # bench/ is on sys.path when this script runs
from _threads import CpuBreakdown
from torch import nn
from torch.nn import functional

import zkdv
from zkdv.verify import verify_transcript

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "torch"))
import lm as lm_recipe  # examples/torch/lm.py

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ``min`` estimates the unloaded time on a shared machine: other processes only add time.
STATISTICS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, length, dim))
        return x + self.down(functional.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(512, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


Forward = Callable[..., Any]
Backward = Callable[[torch.Tensor], None]


@dataclass
class Workload:
    """One benchmarked training step.

    ``step(model, optimizer, batch, forward, backward)`` is the whole step: eager code
    with ``model(...)`` and ``loss.backward()``, or the attested step with
    ``proof.forward`` and ``proof.backward``; ``schedule(optimizer)`` makes the learning
    rate schedule stepped after every step, if the workload has one.
    """

    model: nn.Module
    step: Callable[[nn.Module, Any, Any, Forward, Backward], None]
    batch: Callable[[int], Any]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    schedule: Callable[[Any], Any] | None = None


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _plain_step(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def step(model: nn.Module, optimizer: Any, data: Any, forward: Forward, backward: Backward):
        backward(loss_fn(model, data, forward))
        optimizer.step()
        optimizer.zero_grad()

    return step


def lm_loss(model: nn.Module, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
    (tokens,) = batch
    logits = forward(model, tokens[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def mlp_loss(model: nn.Module, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
    inputs, targets = batch
    return functional.cross_entropy(forward(model, inputs), targets)


def lm_workload() -> Workload:
    generator = torch.Generator().manual_seed(1)

    def batch(_: int) -> tuple[torch.Tensor]:
        # 16 x 513 tokens: 8,192 predicted tokens per step.
        return (torch.randint(256, (16, 513), generator=generator).to(DEVICE),)

    return Workload(LM().to(DEVICE), _plain_step(lm_loss), batch, _adam)


def mlp_workload() -> Workload:
    generator = torch.Generator().manual_seed(2)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
    )  # fmt: skip

    def batch(_: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(64, 512, generator=generator)
        return inputs.to(DEVICE), torch.randint(512, (64,), generator=generator).to(DEVICE)

    return Workload(model.to(DEVICE), _plain_step(mlp_loss), batch, _adam)


RECIPE_LM = lm_recipe.LMConfig(vocab=256, width=128, heads=4, layers=2, context=256)


def recipe_lm_workload(autocast: bool = True) -> Workload:
    config = RECIPE_LM
    batches = lm_recipe.token_batches(config, steps=10**6, micro_batches=2, rows=8, seed=3)

    def step(model: nn.Module, optimizer: Any, batch: Any, forward: Forward, backward: Backward):
        for micro in batch.unbind(0):
            with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
                logits = forward(model, micro[:, :-1])
            loss = functional.cross_entropy(
                logits.float().reshape(-1, config.vocab), micro[:, 1:].reshape(-1)
            )
            backward(loss / batch.shape[0])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        groups = lm_recipe.parameter_groups(model, 0.1)
        return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))

    def schedule(optimizer: Any) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lm_recipe.warmup_cosine(10, 1000))

    return Workload(
        lm_recipe.TinyLM(config).to(DEVICE),
        step,
        lambda _: next(batches).to(DEVICE),
        optimizer,
        schedule,
    )


def _time_waits(proof: Any, total: list[float]) -> None:
    """Add to ``total[0]`` the seconds the training thread waits in ``proof``: admission,
    the mutation barrier and a free snapshot slot (wrapping the instance's methods)."""
    main = threading.main_thread()

    def timed(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if threading.current_thread() is main:
                    total[0] += time.perf_counter() - start

        return wrapper

    proof._admit = timed(proof._admit)
    proof._barrier = timed(proof._barrier)
    start_replays = proof._start_replays

    def started(*args: Any, **kwargs: Any) -> None:
        start_replays(*args, **kwargs)
        proof._checkpoint.take = timed(proof._checkpoint.take)

    proof._start_replays = started


def _call(model: nn.Module, *args: Any) -> Any:
    return model(*args)


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def run(
    name: str, factory: Callable[[], Workload], args: argparse.Namespace, root: str
) -> dict[str, Any]:
    workload = factory()
    template, batch = workload.model, workload.batch
    variants: dict[str, dict[str, Any]] = {}
    # Seconds the training thread spent waiting in ZKDV (admission, the mutation
    # barrier, a free snapshot slot), per variant.
    waits: dict[str, list[float]] = {
        label: [0.0] for label in ("eager", "zkdv", "zkdv p=0", "check-every-1")
    }

    def make(label: str, policy: zkdv.SamplingPolicy | None) -> None:
        model = copy.deepcopy(template)
        optimizer: Any = workload.optimizer(model)
        proof = None
        if policy is not None:
            proof = zkdv.torch.ZKDV(
                os.path.join(root, f"{name}-{label}"),
                zkdv.ZKDVConfig(sampling_policy=policy, chunk_bytes=args.chunk_bytes),
                replay_snapshot_interval=12,
            )
            # Without checks the program never runs: seal it quickly.
            proof.program_kind = (
                args.program if policy.probability or policy.check_every else ("torch.export")
            )
            proof.start(rolling_window=4, probe_ratio=0.01)
            model, optimizer = proof.prepare(model, optimizer)

            @proof.attest
            def attested_step(model: nn.Module, optimizer: Any, data: Any) -> None:
                workload.step(model, optimizer, data, proof.forward, proof.backward)

            _time_waits(proof, waits[label])

        variants[label] = {
            "proof": proof,
            "model": model,
            "optimizer": optimizer,
            "schedule": None if workload.schedule is None else workload.schedule(optimizer),
            "times": [],
            "cpu": [],
            "waits": [],
            "threads": CpuBreakdown(),
            "checked": [],
            "i": 0,
            "seal": 0.0,
        }

    make("eager", None)
    make("zkdv", zkdv.SamplingPolicy(update_check_probability=0.01))
    make("zkdv p=0", zkdv.SamplingPolicy(update_check_probability=0.0))
    if args.checked:
        make("check-every-1", zkdv.SamplingPolicy.DEBUGCheckEvery(1))

    def block(label: str, steps: int) -> float:
        v = variants[label]
        model, optimizer, proof = v["model"], v["optimizer"], v["proof"]
        data = [batch(v["i"] + k) for k in range(steps)]
        _sync()
        waited = waits[label][0]
        cpu = time.process_time()
        start = time.perf_counter()
        with v["threads"].block(steps):
            for item in data:
                if proof is None:
                    workload.step(model, optimizer, item, _call, _backward)
                else:
                    with proof.transaction(batch=item):
                        workload.step(model, optimizer, item, _call, proof.backward)
                if v["schedule"] is not None:
                    v["schedule"].step()
                v["i"] += 1
            _sync()
            if proof is not None:
                proof.join()
        v["cpu"].append((time.process_time() - cpu) / steps)
        v["waits"].append((waits[label][0] - waited) / steps)
        if proof is not None:
            # Checks recorded so far; the block's own are the difference (after join).
            v["checked"].append(proof.runtime.core.checks)
        return (time.perf_counter() - start) / steps

    for label, v in variants.items():  # seal (first transaction) and warm up
        started = time.perf_counter()
        block(label, 1)
        v["seal"] = v["proof"].sealing_seconds if v["proof"] is not None else 0.0
        v["first"] = time.perf_counter() - started
        block(label, 2)
    for v in variants.values():
        v["cpu"].clear()
        v["waits"].clear()
        v["checked"][:-1] = []  # the count before the first timed block
        v["threads"] = CpuBreakdown()
    labels = list(variants)
    for round_ in range(args.rounds):
        # Rotated every round: no variant always runs right after the same other one
        # (a block pays for what the block before it left behind: dirty pages being
        # written back, a cold cache), so position does not pass for overhead.
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            variants[label]["times"].append(block(label, args.steps))

    eager = variants["eager"]
    leaves = [p.detach() for p in eager["model"].parameters()]
    for state in eager["optimizer"].state.values():
        leaves.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    flat = np.concatenate([t.cpu().reshape(-1).view(torch.uint8).numpy() for t in leaves])
    hashes, hash_cpu = [], []
    for _ in range(5):
        cpu = time.process_time()
        start = time.perf_counter()
        blake3.blake3(memoryview(flat), max_threads=blake3.blake3.AUTO).digest()
        hashes.append(time.perf_counter() - start)
        hash_cpu.append(time.process_time() - cpu)
    state_bytes = flat.nbytes
    ms = {label: STATISTICS[args.stat](v["times"]) * 1e3 for label, v in variants.items()}
    floor = floor_lines(
        flat,
        plain_ms=ms["eager"],
        hash_ms=min(hashes) * 1e3,
        added_ms=ms["zkdv"] - ms["eager"],
        # Every Torch run commits its gradient (the trained parameters' shapes).
        gradient_bytes=sum(
            p.numel() * p.element_size() for p in eager["model"].parameters() if p.requires_grad
        ),
    )
    del flat
    checks = {}
    for label, v in variants.items():
        if v["proof"] is not None:
            v["proof"].close()
            report = verify_transcript(v["proof"].path)
            assert report.ok, report.summary()
            checks[label] = report.checks
    return {
        "name": name,
        "params": sum(p.numel() for p in template.parameters()),
        "state_mib": state_bytes / 2**20,
        "blake3_ms": min(hashes) * 1e3,
        "blake3_cpu_ms": min(hash_cpu) * 1e3,
        "cpu_ms": {label: STATISTICS[args.stat](v["cpu"]) * 1e3 for label, v in variants.items()},
        "wait_ms": {
            label: STATISTICS[args.stat](v["waits"]) * 1e3 for label, v in variants.items()
        },
        # Per round, the default policy's block time minus p = 0's (same round).
        "paired_ms": [
            (a - b) * 1e3
            for a, b in zip(variants["zkdv"]["times"], variants["zkdv p=0"]["times"], strict=True)
        ],
        # Per round, each ZKDV variant's block time over the eager block's (same round).
        "paired_ratio": {
            label: [a / b for a, b in zip(v["times"], variants["eager"]["times"], strict=True)]
            for label, v in variants.items()
            if v["proof"] is not None
        },
        # Per round, whether the default policy's block ran a sampled check: the
        # issue's goal is the step-time ratio when no check runs.
        "checked_round": [
            after > before for before, after in itertools.pairwise(variants["zkdv"]["checked"])
        ],
        "threads": {label: v["threads"] for label, v in variants.items()},
        "load": os.getloadavg()[0],
        "ms": ms,
        "floor": floor,
        "seal_s": {label: v["seal"] for label, v in variants.items() if v["proof"] is not None},
        "checks": checks,
        "steps": {label: v["i"] for label, v in variants.items()},
    }


def report(result: dict[str, Any], program: str) -> None:
    ms = result["ms"]
    base = ms["eager"]
    print(
        f"\n[{result['name']}] {result['params'] / 1e6:.2f}M params, committed state "
        f"{result['state_mib']:.1f} MiB, raw blake3 (all threads) {result['blake3_ms']:.1f} ms "
        f"wall, {result['blake3_cpu_ms']:.1f} ms CPU; load average {result['load']:.1f}"
    )
    for label, value in ms.items():
        drawn = ""
        if label in result["checks"]:
            drawn = (
                f"  ({result['checks'][label]} sampled checks in {result['steps'][label]} steps)"
            )
        cpu = result["cpu_ms"][label]
        print(
            f"  {label:14s} {value:8.1f} ms/step  ratio {value / base:6.3f}  "
            f"CPU {cpu:8.1f} ms/step  training thread waiting in ZKDV "
            f"{result['wait_ms'][label]:6.2f} ms/step{drawn}"
        )
    paired = result["paired_ms"]
    print(
        f"  default policy - p=0, same round: median {statistics.median(paired):+.1f} ms/step "
        f"(rounds {', '.join(f'{d:+.1f}' for d in paired)}); "
        f"{result['checks'].get('zkdv', 0)} vs {result['checks'].get('zkdv p=0', 0)} "
        "sampled checks"
    )
    for label, ratios in result["paired_ratio"].items():
        # Against the eager block of the same round: a slow stretch of the machine hits
        # both, so this moves less between runs than the ratio of the medians above.
        print(
            f"  {label} / eager, same round: median step-time ratio "
            f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)})"
        )
    unchecked = [i for i, checked in enumerate(result["checked_round"]) if not checked]
    if unchecked:
        # The default policy on steps that drew no check: what it costs most steps.
        ratios = [result["paired_ratio"]["zkdv"][i] for i in unchecked]
        differences = [paired[i] for i in unchecked]
        print(
            f"  zkdv / eager, same round, the {len(unchecked)} of {len(paired)} rounds whose "
            f"default-policy block drew no check: median step-time ratio "
            f"{statistics.median(ratios):.3f}; default policy - p=0 "
            f"{statistics.median(differences):+.1f} ms/step"
        )
    # Per thread, from each thread's CPU clock: far steadier than the step-time ratio.
    threads = result["threads"]
    for label, breakdown in threads.items():
        print(breakdown.line(label, None if label == "eager" else ("eager", threads["eager"])))
    for label in ("zkdv", "zkdv p=0"):
        added = ms[label] - base
        print(
            f"  added by the ZKDV transaction ({label}): {added:.1f} ms/step = "
            f"{added / result['blake3_ms']:.2f} x raw blake3 of the state; step-time ratio "
            f"{ms[label] / base:.3f}"
        )
        added_cpu = result["cpu_ms"][label] - result["cpu_ms"]["eager"]
        print(
            f"  added process CPU time ({label}): {added_cpu:.1f} ms/step = "
            f"{added_cpu / result['blake3_cpu_ms']:.2f} x the CPU time of raw blake3"
        )
    for line in result["floor"]:
        print(line)
    seconds = result["seal_s"]["zkdv"]
    print(f"  one-time sealing ({program}) on the first transaction: {seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 6 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", choices=("lm", "mlp"))
    parser.add_argument(
        "--recipe",
        choices=("lm", "hf-trainer"),
        help="run the LM recipe of examples/torch/lm.py instead, or a Hugging Face Trainer "
        "run with zkdv.integrations (bench/hf_trainer_overhead.py)",
    )
    parser.add_argument("--checked", action="store_true", help="add DEBUGCheckEvery(1)")
    parser.add_argument(
        "--no-autocast",
        dest="autocast",
        action="store_false",
        help="the recipe without its bf16 autocast (a CPU without native bfloat16 runs it "
        "~10x slower, which hides the overhead in noise)",
    )
    parser.add_argument(
        "--program",
        choices=("aot-inductor", "torch.export"),
        default=os.environ.get("ZKDV_TORCH_PROGRAM") or "torch.export",
        help="the sealed program kind (default: the product default, torch.export)",
    )
    parser.add_argument(
        "--stat",
        choices=sorted(STATISTICS),
        default="median",
        help="block statistic; min suits a machine shared with other work",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=zkdv.ZKDVConfig().chunk_bytes,
        help="Merkle chunk size (default: ZKDVConfig's)",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 6
    if args.recipe == "hf-trainer":
        import hf_trainer_overhead

        options = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        hf_trainer_overhead.main([*options, *([] if args.autocast else ["--no-autocast"])])
        return
    print(
        f"torch {torch.__version__} on {DEVICE} ({torch.get_num_threads()} threads), "
        f"{os.cpu_count()} cpus; {args.rounds} rounds x {args.steps} steps per variant; "
        f"Merkle chunks of {args.chunk_bytes} bytes"
    )
    with tempfile.TemporaryDirectory(prefix="zkdv-bench-") as root:
        if args.recipe == "lm":
            torch.manual_seed(0)
            name = "recipe lm" + ("" if args.autocast else " (no autocast)")
            factory = functools.partial(recipe_lm_workload, autocast=args.autocast)
            report(run(name, factory, args, root), args.program)
            return
        for name, workload in (("lm", lm_workload), ("mlp", mlp_workload)):
            if args.only in (None, name):
                torch.manual_seed(0)
                report(run(name, workload, args, root), args.program)


if __name__ == "__main__":
    main()
