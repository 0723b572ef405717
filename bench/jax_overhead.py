"""ZKDV's JAX overhead: ``jax.jit`` versus ``proof.jit``, side by side in one run.

    python bench/jax_overhead.py [--quick] [--rounds 3] [--steps 12] [--only lm|mlp]

Two workloads, each a Flax ``TrainState`` with Adam, the state donated:

* ``lm``: a small causal transformer language model, 16 x 512 = 8,192 tokens per step
  (target: step-time ratio <= 1.02);
* ``mlp``: a 10M-parameter MLP at batch 64, the state-heavy worst case (target: the time
  ZKDV adds per step <= 1.2 x raw ``blake3`` with all threads hashing the same state
  bytes once, measured here; the plain ratio is printed too).

For each workload the same step runs under ``jax.jit``, as ``proof.jit``'s committed
programs alone (``programs only``: the production step with its gradient as an output,
then the canonical update, dispatched as ``proof.jit`` dispatches them, with no
transaction, commitment or thread of ZKDV's: what the protocol asks of XLA), under
``proof.jit`` with the default policy (p = 0.01, N = 12) and under ``proof.jit`` with
``SamplingPolicy.DEBUGCheckEvery(1)``, in interleaved blocks of ``--steps`` steps so that
machine noise hits all alike; a block of a proof ends with ``proof.join()`` so that its
commitments are inside the timing (``DEBUGCheckEvery(1)`` blocks are a quarter as long:
every step replays up to 11 transitions). Reported per variant: the median wall time
per step, the median *process CPU time* per step (all threads; on a shared machine the
wall clock mostly measures the neighbours, the CPU time measures the work), and the
peak resident memory sampled during its blocks. Raw ``blake3`` is timed once per round,
interleaved with the blocks, and compared in wall time (the target) and in CPU time.
Per variant, the CPU time of ZKDV's own threads by stage and of the calling thread, and
the minor page faults per step (``bench/_threads.py``): the programs' fresh output
buffers that the allocator had handed back to the kernel are faulted in again. Last, the
floors of ``bench/_floor.py``, measured in the same run: the check-free floor of hashing
and copies, and the protocol's: that, plus what the committed programs add and the floor
of exactness of the step's probes (post-update, delta and gradient rows).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import blake3
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _floor import floor_lines, probe_floor_ms  # bench/ is on sys.path when this script runs
from _threads import CpuBreakdown
from flax import linen as nn

import zkdv
from zkdv.jax.contrib import TrainState

PROBE_RATIO = 0.01  # proof.start's default


class Block(nn.Module):
    heads: int
    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.SelfAttention(num_heads=self.heads, deterministic=True)(nn.LayerNorm()(x), mask)
        h = nn.Dense(self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class LM(nn.Module):
    vocab: int = 256
    dim: int = 128
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        for _ in range(self.layers):
            x = Block(self.heads, 4 * self.dim)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class MLP(nn.Module):
    widths: tuple[int, ...] = (2048, 2048, 2048, 512)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


def lm_workload() -> tuple[Any, Any, Callable[..., Any], Callable[[int], Any]]:
    batch, seq = 16, 512
    model = LM()
    params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"]

    def step(state: Any, tokens: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            logits = state.apply_fn({"params": p}, tokens[:, :-1].astype(jnp.int32))
            labels = tokens[:, 1:].astype(jnp.int32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rng = np.random.default_rng(0)
    data = [jnp.asarray(rng.integers(0, 256, (batch, seq + 1)), jnp.uint32) for _ in range(4)]
    return model, params, step, lambda i: data[i % len(data)]


def mlp_workload() -> tuple[Any, Any, Callable[..., Any], Callable[[int], Any]]:
    batch, features = 64, 1024
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, features)))["params"]

    def step(state: Any, batch_x: jax.Array, batch_y: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            return jnp.mean((state.apply_fn({"params": p}, batch_x) - batch_y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rng = np.random.default_rng(0)
    data = [
        (
            jnp.asarray(rng.standard_normal((batch, features)), jnp.float32),
            jnp.asarray(rng.standard_normal((batch, 512)), jnp.float32),
        )
        for _ in range(4)
    ]
    return model, params, step, lambda i: data[i % len(data)]


class PeakRSS:
    """Sample this process's resident set size while a block runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakRSS:
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, self.current())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()


class ProgramsOnly:
    """``proof.jit``'s committed programs, run without a transaction or a commitment.

    The first call goes through ``step`` (a real transaction, which compiles the
    programs); every later one calls the driver's dispatch (``_run``: the production
    step, then the apply program writing over the donated parameters) on the same
    flattened arguments ``proof.jit`` passes it. White-box on purpose: it times what the
    protocol costs XLA, apart from what ZKDV's host work costs.
    """

    def __init__(self, proof: Any, step: Callable[..., Any]) -> None:
        self._proof, self._step, self._compiled = proof, step, False

    def __call__(self, state: Any, *data: Any) -> Any:
        if not self._compiled:
            self._compiled = True
            result = self._step(state, *data)
            # Its commitment reads the state the next call donates.
            self._proof.join()
            return result
        program = self._proof._program_owner
        outputs = self._proof._run(program, jax.tree.leaves((state, *data)))
        return program.traced.schema.user_result(outputs, program.trees)


def run(name: str, workload: Any, args: argparse.Namespace, root: str) -> dict[str, Any]:
    model, params, body, batch = workload()
    tx = optax.adam(1e-3)
    variants: dict[str, dict[str, Any]] = {}

    def make(label: str, policy: zkdv.SamplingPolicy | None) -> None:
        proof = None
        if policy is not None:
            proof = zkdv.jax.ZKDV(
                os.path.join(root, f"{name}-{label.replace(' ', '-')}"),
                zkdv.ZKDVConfig(sampling_policy=policy),
                replay_snapshot_interval=12,
            )
            proof.start(rolling_window=4, probe_ratio=PROBE_RATIO)
            step = proof.jit(body, donate_argnums=(0,))
            if label == "programs only":
                step = ProgramsOnly(proof, step)
        else:
            step = jax.jit(body, donate_argnums=(0,))
        state = TrainState.create(proof=proof, apply_fn=model.apply, params=params, tx=tx)
        state = jax.tree.map(jnp.array, state)  # own buffers: the first step donates them
        variants[label] = {
            "proof": proof,
            "step": step,
            "state": state,
            "times": [],
            "cpu": [],
            "rss": PeakRSS(),
            "threads": CpuBreakdown(),
            "checked": [],
            "i": 0,
        }

    make("jax.jit", None)
    make("programs only", zkdv.SamplingPolicy(update_check_probability=0.0))
    make("proof.jit", zkdv.SamplingPolicy(update_check_probability=0.01))
    make("check-every-1", zkdv.SamplingPolicy.DEBUGCheckEvery(1))

    def block(label: str, steps: int) -> tuple[float, float]:
        v = variants[label]
        with v["rss"], v["threads"].block(steps):
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                data = batch(v["i"])
                v["state"] = v["step"](v["state"], *(data if isinstance(data, tuple) else (data,)))
                v["i"] += 1
            jax.block_until_ready(v["state"])
            if v["proof"] is not None:
                v["proof"].join()
            elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        if v["proof"] is not None:
            # Checks recorded so far; the block's own are the difference (after join).
            v["checked"].append(v["proof"].runtime.core.checks)
        return elapsed / steps, used / steps

    plain = variants["jax.jit"]["state"]
    leaves = [np.asarray(x) for x in jax.tree.leaves((plain.params, plain.opt_state))]
    state_bytes = sum(a.nbytes for a in leaves)
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in leaves])
    del leaves, plain
    hashes: list[tuple[float, float]] = []

    def hash_once() -> None:
        best = (float("inf"), float("inf"))
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            blake3.blake3(memoryview(flat), max_threads=blake3.blake3.AUTO).digest()
            best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
        hashes.append(best)

    for label, v in variants.items():  # compile and warm up
        block(label, 2)
        v["threads"] = CpuBreakdown()
        v["checked"][:-1] = []  # the count before the first timed block
    for _ in range(args.rounds):
        hash_once()
        for label in variants:
            steps = args.steps if label != "check-every-1" else max(2, args.steps // 4)
            wall, cpu = block(label, steps)
            variants[label]["times"].append(wall)
            variants[label]["cpu"].append(cpu)
    for label in ("programs only", "proof.jit", "check-every-1"):
        variants[label]["proof"].close()
    result = {
        "name": name,
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "state_mib": state_bytes / 2**20,
        "blake3_ms": statistics.median(h[0] for h in hashes) * 1e3,
        "blake3_cpu_ms": statistics.median(h[1] for h in hashes) * 1e3,
        "ms": {label: statistics.median(v["times"]) * 1e3 for label, v in variants.items()},
        "cpu_ms": {label: statistics.median(v["cpu"]) * 1e3 for label, v in variants.items()},
        "rss_mib": {label: v["rss"].peak / 2**20 for label, v in variants.items()},
        "threads": {label: v["threads"] for label, v in variants.items()},
    }
    # proof.jit's blocks that drew no sampled check, and jax.jit's of the same rounds:
    # the goal is the step-time ratio when no check runs.
    counts = variants["proof.jit"]["checked"]
    unchecked = [i for i, (a, b) in enumerate(itertools.pairwise(counts)) if b == a]
    # The check-free floor against the rounds that drew no check, where there are any.
    rounds = unchecked or list(range(len(counts) - 1))
    ms = {
        label: statistics.median(variants[label]["times"][i] for i in rounds) * 1e3
        for label in ("jax.jit", "programs only", "proof.jit")
    }
    if unchecked:
        result["unchecked"] = (len(unchecked), args.rounds, ms["proof.jit"], ms["jax.jit"])
    result["floor"] = floor_lines(
        flat,
        plain_ms=ms["jax.jit"],
        hash_ms=result["blake3_ms"],
        added_ms=ms["proof.jit"] - ms["jax.jit"],
        # The step calls TrainState.apply_gradients: the run commits its gradient.
        gradient_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
        programs_ms=ms["programs only"] - ms["jax.jit"],
        # Post-update, delta and gradient rows of every parameter, each step.
        probes_ms=probe_floor_ms(
            [np.asarray(x) for x in jax.tree.leaves(params)], PROBE_RATIO, arrays=3
        ),
        measured=(
            f"the medians of the {len(unchecked)} of {args.rounds} rounds that drew no check"
            if unchecked
            else "every round drew a check"
        ),
    )
    return result


def report(result: dict[str, Any]) -> None:
    ms, cpu = result["ms"], result["cpu_ms"]
    base, base_cpu = ms["jax.jit"], cpu["jax.jit"]
    print(
        f"\n[{result['name']}] {result['params'] / 1e6:.2f}M params, committed state "
        f"{result['state_mib']:.1f} MiB, raw blake3 (all threads) "
        f"{result['blake3_ms']:.1f} ms wall, {result['blake3_cpu_ms']:.1f} ms cpu"
    )
    for label in ms:
        print(
            f"  {label:14s} {ms[label]:8.1f} ms/step wall (ratio {ms[label] / base:6.3f})"
            f"  {cpu[label]:8.1f} ms/step cpu (ratio {cpu[label] / base_cpu:6.3f})"
            f"  peak RSS {result['rss_mib'][label]:8.1f} MiB"
        )
    added, added_cpu = ms["proof.jit"] - base, cpu["proof.jit"] - base_cpu
    print(
        f"  added by proof.jit: {added:.1f} ms/step wall = {added / result['blake3_ms']:.2f} x "
        f"raw blake3 wall; {added_cpu:.1f} ms/step cpu = "
        f"{added_cpu / result['blake3_cpu_ms']:.2f} x raw blake3 cpu"
    )
    print(
        f"  step-time ratio {ms['proof.jit'] / base:.3f} wall, {cpu['proof.jit'] / base_cpu:.3f} "
        f"cpu; DEBUGCheckEvery(1) ratio {ms['check-every-1'] / base:.3f} wall, "
        f"{cpu['check-every-1'] / base_cpu:.3f} cpu"
    )
    if "unchecked" in result:
        count, rounds, proof_ms, plain_ms = result["unchecked"]
        print(
            f"  the {count} of {rounds} rounds whose proof.jit block drew no check: proof.jit "
            f"{proof_ms:.1f} ms/step, jax.jit {plain_ms:.1f}, step-time ratio "
            f"{proof_ms / plain_ms:.3f}"
        )
    # XLA runs the programs on its own threads: the calling thread only dispatches.
    threads = result["threads"]
    for label, breakdown in threads.items():
        baseline = None if label == "jax.jit" else ("jax.jit", threads["jax.jit"])
        print(breakdown.line(label, baseline, caller="calling thread"))
    for line in result["floor"]:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", choices=("lm", "mlp"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 4
    print(
        f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} devices), "
        f"{os.cpu_count()} cpus; {args.rounds} rounds x {args.steps} steps per variant"
    )
    with tempfile.TemporaryDirectory(prefix="zkdv-bench-") as root:
        for name, workload in (("lm", lm_workload), ("mlp", mlp_workload)):
            if args.only in (None, name):
                report(run(name, workload, args, root))


if __name__ == "__main__":
    main()
