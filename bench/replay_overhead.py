"""Server-side replay cost: one replayed transition versus the training step it checks.

    python bench/replay_overhead.py [--quick] [--only jax|torch] [--rounds 5]
                                    [--window 8] [--width 1024] [--batch 256] [--threads N]
                                    [--program torch.export|aot-inductor]

For each framework the same workload (an MLP ``width -> 2 width -> 2 width -> 10`` with
AdamW, batch 256, softmax cross-entropy) is trained with ZKDV (``replay_snapshot_interval``
= ``--window``, no SDK-side checks, snapshot and batch files kept), then, on the same
machine and interleaved in rounds so that noise hits both alike:

* the *training step*: a block of ``--window`` plain steps (``jax.jit`` of Flax's
  ``TrainState.apply_gradients`` / an eager ``torch.optim.AdamW`` step), per step;
* the *replay*: ``provers.<framework>_replay.verify_challenge`` of a whole window
  (``--window`` transitions) with the transition already loaded. The time between two
  consecutive transition calls (median over the window) is one replayed step: the
  program, the optimizer update, the state-root Merkle hashing of the replayed
  post-state (how an exact replay is compared), the probes and the next batch file's
  check. The rest of a challenge (the offline transcript verification, reading and
  hashing the snapshot) is the *fixed cost per challenge*.

The one-time artifact load (decoding plus the first call's compilation) is reported
apart. Challenges per hour per worker assume a uniformly random challenged step, which
replays ``(window + 1) / 2`` transitions on average from its snapshot, with the
artifact loaded once per proof. Target: replay per transition <= 1.5 x the training step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "agent" / "zkdv" / "src"),
    str(Path(__file__).resolve().parents[1] / "agent" / "dvbench" / "src"),
]

import zkdv  # noqa: E402

FEATURES = 64
CLASSES = 10


def _data(steps: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((batch, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, batch).astype(np.int32),
        )
        for _ in range(steps)
    ]


def _config() -> zkdv.ZKDVConfig:
    return zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))


def jax_workload(args: argparse.Namespace, path: Path) -> tuple[Callable[[], float], Any]:
    """Train with zkdv.jax into ``path``; return a plain-step block timer and the prover."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import linen as nn
    from flax.training import train_state

    from provers import jax_replay
    from zkdv.jax.contrib import TrainState

    width = args.width

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = jnp.tanh(nn.Dense(2 * width)(jnp.tanh(nn.Dense(width)(x))))
            return nn.Dense(CLASSES)(jnp.tanh(nn.Dense(2 * width)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((args.batch, FEATURES)))["params"]
    # The proof's step donates its parameters: the plain step gets its own copy.
    plain_params = jax.tree.map(jnp.copy, params)

    def step(state: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    data = [(jnp.asarray(x), jnp.asarray(y)) for x, y in _data(2 * args.window, args.batch)]
    proof = zkdv.jax.ZKDV(path, _config(), replay_snapshot_interval=args.window)
    proof.start(rolling_window=2, probe_ratio=0.01)
    state = TrainState.create(
        proof=proof, apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
    )
    proved = proof.jit(step, donate_argnums=(0,))
    for x, y in data:
        state = proved(state, x, y)
    proof.close()

    plain_state = train_state.TrainState.create(
        apply_fn=model.apply, params=plain_params, tx=optax.adamw(1e-3)
    )
    plain = jax.jit(step, donate_argnums=(0,))
    holder = [jax.block_until_ready(plain(plain_state, *data[0]))]

    def block() -> float:
        started = time.perf_counter()
        current = holder[0]
        for x, y in data[: args.window]:
            current = plain(current, x, y)
        jax.block_until_ready(current)
        holder[0] = current
        return (time.perf_counter() - started) / args.window

    return block, jax_replay


def torch_workload(args: argparse.Namespace, path: Path) -> tuple[Callable[[], float], Any]:
    """Train with zkdv.torch into ``path``; return a plain-step block timer and the prover."""
    import copy

    import torch
    from torch import nn
    from torch.nn import functional

    from provers import torch_replay

    width = args.width
    if args.threads:
        # Recorded by the run (env.threads); the replay runs with the same count.
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, width),
        nn.Tanh(),
        nn.Linear(width, 2 * width),
        nn.Tanh(),
        nn.Linear(2 * width, 2 * width),
        nn.Tanh(),
        nn.Linear(2 * width, CLASSES),
    )
    plain_model = copy.deepcopy(model)
    data = [
        (torch.from_numpy(x), torch.from_numpy(y).long())
        for x, y in _data(2 * args.window, args.batch)
    ]

    proof = zkdv.torch.ZKDV(path, _config(), replay_snapshot_interval=args.window)
    proof.program_kind = args.program
    proof.start(rolling_window=16, probe_ratio=0.01)
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    @proof.attest
    def attested(model: nn.Module, optimizer: Any, batch: Any) -> None:
        x, y = batch
        proof.backward(functional.cross_entropy(proof.forward(model, x), y))
        optimizer.step()
        optimizer.zero_grad()

    for x, y in data:
        with proof.transaction(batch=(x, y)):
            proof.backward(functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    proof.close()
    print(
        f"  torch: one-time sealing ({args.program}) {proof.sealing_seconds:.1f} s (training side)"
    )

    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)

    def block() -> float:
        started = time.perf_counter()
        for x, y in data[: args.window]:
            functional.cross_entropy(plain_model(x), y).backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()
        return (time.perf_counter() - started) / args.window

    block()  # warm-up: lazily created optimizer state, allocator
    return block, torch_replay


def run(name: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    path = Path(root) / name
    workload = jax_workload if name == "jax" else torch_workload
    block, prover = workload(args, path)
    window = args.window

    started = time.perf_counter()
    loaded = prover.load_transition(path)
    load = time.perf_counter() - started
    calls: list[float] = []

    def timed(function: Any) -> Any:
        # The time between two calls is one whole replayed step: the transition, the
        # Merkle roots of the replayed state, its probes and the next batch's check. A
        # run that commits its gradients replays each step in two halves; the first
        # (the gradient program) starts the step.
        if function is None:
            return None

        def call(*arguments: Any) -> Any:
            calls.append(time.perf_counter())
            return function(*arguments)

        return call

    transition = dataclasses.replace(loaded, step=timed(loaded.step), compute=timed(loaded.compute))

    def challenge(step: int, through: int) -> float:
        calls.clear()
        started = time.perf_counter()
        verdict = prover.verify_challenge(path, step, through=through, transition=transition)
        elapsed = time.perf_counter() - started
        assert verdict.ok, verdict.message
        assert all(e.exact for e in verdict.evidence) or args.program == "aot-inductor"
        return elapsed

    first_call = challenge(0, 0)  # compiles the program (JAX) on its first call
    steps, transitions, fixed = [], [], []
    for _ in range(args.rounds):
        steps.append(block())
        total = challenge(window, 2 * window - 1)
        intervals = np.diff(calls)
        transitions.append(float(np.median(intervals)))
        fixed.append(total - float(np.sum(intervals)) - transitions[-1])
    step, per_transition = statistics.median(steps), statistics.median(transitions)
    fixed_cost = max(0.0, statistics.median(fixed))
    average = fixed_cost + (window + 1) / 2 * per_transition
    state_mib = (
        sum(f.stat().st_size for f in (path / "files").glob(f"snapshot-{window:08d}.*")) / 2**20
    )
    return {
        "name": name,
        "state_mib": state_mib,
        "step_ms": 1e3 * step,
        "transition_ms": 1e3 * per_transition,
        # Per round, so that a noisy round weighs on both sides of its ratio.
        "ratio": statistics.median(r / t for r, t in zip(transitions, steps, strict=True)),
        "best_step_ms": 1e3 * min(steps),
        "best_transition_ms": 1e3 * min(transitions),
        "best_ratio": min(transitions) / min(steps),
        "fixed_ms": 1e3 * fixed_cost,
        "load_s": load + max(0.0, first_call - fixed_cost - per_transition),
        "per_hour": 3600.0 / average,
        "average_ms": 1e3 * average,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n[{result['name']}] width {args.width}, batch {args.batch}, committed state {result['state_mib']:.1f} MiB, "
        f"window {args.window}"
    )
    print(f"  training step (plain)        {result['step_ms']:8.1f} ms")
    print(
        f"  replay per transition        {result['transition_ms']:8.1f} ms  "
        f"ratio {result['ratio']:.2f} (target <= 1.5)"
    )
    print(
        f"  best rounds: step {result['best_step_ms']:.1f} ms, transition "
        f"{result['best_transition_ms']:.1f} ms, ratio {result['best_ratio']:.2f}"
    )
    print(f"  fixed cost per challenge     {result['fixed_ms']:8.1f} ms")
    print(f"  one-time artifact load       {result['load_s']:8.2f} s")
    print(
        f"  challenges per hour per worker {result['per_hour']:8.0f} "
        f"(random step: {result['average_ms']:.0f} ms each, artifact loaded once)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 256, window 4, 3 rounds")
    parser.add_argument("--only", choices=("jax", "torch"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--threads", type=int, default=0, help="Torch intra-op threads (default: Torch's)"
    )
    parser.add_argument(
        "--program",
        choices=("torch.export", "aot-inductor"),
        default=os.environ.get("ZKDV_TORCH_PROGRAM", "torch.export"),
        help="the Torch run's sealed program kind",
    )
    args = parser.parse_args()
    if args.quick:
        args.width, args.window, args.rounds = 256, 4, 3
    print(f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="zkdv-replay-bench-") as root:
        for name in ("jax", "torch"):
            if args.only in (None, name):
                report(run(name, args, root), args)


if __name__ == "__main__":
    main()
