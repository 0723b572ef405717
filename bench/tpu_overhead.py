"""ZKDV's cost on a TPU: plain ``jax.jit`` against ``proof.jit``, side by side in one run.

    python bench/tpu_overhead.py [--rounds 4] [--steps 8] [--tiny] [--policies 0,0.01]
        [--stack-limit N] [--compare-stack-limits A,B]

The workload keeps the chip busy: a causal transformer language model of about 135M
parameters (12 blocks, d = 768, 12 heads, MLP 3072, vocabulary 32768, untied head),
float32 parameters computing in bfloat16, sequence length 1024, batch 8 (8,192 tokens a
step), AdamW. Three variants, in interleaved blocks of ``--steps`` steps so that any
drift hits all alike, each block ending with the state on the host's side of the
barrier (``block_until_ready``) and, for a proof, ``proof.join()``, so its commitments
are inside the timing:

* ``jax.jit``: the step as a lab writes it, state donated;
* ``proof.jit p=0``: every step committed (device path: the chunk roots and the probes
  computed on the chip; the gradient committed, the canonical update applied), no
  sampled check: the steps "without a drawn check" of the issue's goal;
* ``proof.jit p=0.01``: the default policy.

``--policies`` names the proofs' check probabilities (default ``0,0.01``); ``--policies
0`` times only the steps of the goal, for a run whose device time is short (each proof
compiles its first step for minutes on a TPU).

Goals (issue 60): ``proof.jit`` at the default policy at most 1.05x ``jax.jit`` on steps
without a drawn check (the ``p=0`` row); the device commitment's time per step at most
1.5x one read of the state from HBM (v5e: about 819 GB/s). The commitment is timed
alone too: the chunk-roots and probe programs on the step's state, against a measured
read of the same bytes (a bitwise reduction over every leaf) and against the
bandwidth figure.

The first block of each variant (its compile) is timed and printed as it ends, with
XLA's compiles in it (how many programs, their seconds, the largest), so that a run cut
short still tells where the time went. XLA's persistent compilation cache (a
temporary directory unless ``JAX_COMPILATION_CACHE_DIR`` names one) lets the second
proof reuse the first one's programs. ``--stack-limit N`` sets the largest leaf (in
elements) whose canonical update is stacked with the other leaves of its shape
(``zkdv.jax.canonical.stack_limit``; 0: none, each leaf its own program), to
weigh the stack's copies at every step against its shorter compile (``docs/jax.md``
11.2); ``--compare-stack-limits A,B`` adds a ``p=0`` variant for each limit, in the same
rounds.

A proof copies its state to the host at every ``SNAPSHOT_INTERVAL``-th step (the
replay's snapshots; 1.5 GiB here). The rounds that hold no such step are the steady
steps the goal speaks of; each proof prints their median beside the rounds' median and
what a round with a snapshot cost more, per snapshot (a lab's interval is its own: the
snapshot's cost per step is that figure over the interval).

After the rounds, each proof prints what it read back from the device over the run, per
kind (``proof.transfers``: the batch, the roots, the probes, the snapshots, the state on
the host path), and ``--profile DIR`` writes a ``jax.profiler`` trace of one more block of
each variant under ``DIR`` (open it in Perfetto or TensorBoard), so that one run says
where a proof's step spends its time on the device and on the host.

``--tiny`` shrinks the model to a few layers of d = 128 and a sequence of 128, so that
the script can be checked on a CPU; its numbers mean nothing for a TPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import zkdv
from zkdv.device_merkle import roots_to_bytes
from zkdv.jax.canonical import stack_limit
from zkdv.jax.contrib import TrainState
from zkdv.jax.device_merkle import chunk_roots
from zkdv.merkle import commit_state

HBM_BYTES_PER_SECOND = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}


class Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(self.heads, dtype=jnp.bfloat16)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        h = nn.Dense(4 * self.d, dtype=jnp.bfloat16)(h)
        return x + nn.Dense(self.d, dtype=jnp.bfloat16)(nn.gelu(h))


class LM(nn.Module):
    vocab: int
    d: int
    layers: int
    heads: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d, dtype=jnp.bfloat16)(tokens)
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        return nn.Dense(self.vocab, dtype=jnp.bfloat16)(x).astype(jnp.float32)


#: The proofs' ``replay_snapshot_interval``: every such step copies the state to the host.
SNAPSHOT_INTERVAL = 12


def model_for(tiny: bool) -> tuple[LM, int, int]:
    """The model, its batch size and its sequence length."""
    if tiny:
        return LM(vocab=512, d=128, layers=2, heads=4), 2, 128
    return LM(vocab=32768, d=768, layers=12, heads=12), 8, 1024


def workload(tiny: bool) -> tuple[LM, Any, int, int]:
    model, batch, length = model_for(tiny)
    params = model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    return model, params, batch, length


class CompileLog:
    """XLA's backend compiles as they finish (``jax.monitoring``): how many, how long."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds.append(duration)

    def since(self, start: int) -> str:
        new = self.seconds[start:]
        largest = ", ".join(f"{t:.1f}" for t in sorted(new, reverse=True)[:4])
        return f"{len(new)} programs, {sum(new):.1f} s in XLA (largest: {largest} s)"


def train_step(state: Any, tokens: jax.Array) -> Any:
    def loss(params: Any) -> jax.Array:
        logits = state.apply_fn({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def state_read_seconds(leaves: list[jax.Array], repeats: int = 10) -> float:
    """One read of every byte of the state on the device, measured: an XOR over each
    leaf's 32-bit words (what hashing must at least do)."""

    @jax.jit
    def read(leaves: list[jax.Array]) -> jax.Array:
        total = jnp.uint32(0)
        for leaf in leaves:
            words = jax.lax.bitcast_convert_type(leaf.reshape(-1), jnp.uint32)
            total = total ^ jax.lax.reduce(words, jnp.uint32(0), jax.lax.bitwise_xor, (0,))
        return total

    jax.block_until_ready(read(leaves))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(read(leaves))
    return (time.perf_counter() - start) / repeats


def commitment_seconds(leaves: list[jax.Array], chunk_bytes: int, repeats: int = 10) -> float:
    """The chunk roots of every leaf on the device (the commitment's hashing), alone."""
    jax.block_until_ready(chunk_roots(leaves, chunk_bytes))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(chunk_roots(leaves, chunk_bytes))
    return (time.perf_counter() - start) / repeats


def measure_commitment(state: Any, device: Any) -> None:
    """Print the device commitment's time on ``state`` against one read of its bytes."""
    leaves = jax.tree.leaves((state.params, state.opt_state))
    leaves = [leaf for leaf in leaves if isinstance(leaf, jax.Array) and leaf.size]
    nbytes = sum(leaf.nbytes for leaf in leaves)
    read = state_read_seconds(leaves)
    chunk_bytes = zkdv.ZKDVConfig().chunk_bytes
    hashing = commitment_seconds(leaves, chunk_bytes)
    device_roots = roots_to_bytes(jax.device_get(chunk_roots(leaves, chunk_bytes)))
    host = commit_state([(str(i), np.asarray(leaf)) for i, leaf in enumerate(leaves)], chunk_bytes)
    same = sum(a == b for a, b in zip(device_roots, host.chunk_roots, strict=True))
    print(f"device roots equal to the host's: {same} of {len(leaves)} leaves")
    bandwidth = HBM_BYTES_PER_SECOND.get(device.device_kind)
    print(f"state: {nbytes / 2**20:.0f} MiB (parameters and optimizer state)")
    print(f"one read of the state, measured: {read * 1e3:.2f} ms")
    print(
        f"device chunk roots of the state: {hashing * 1e3:.2f} ms = {hashing / read:.2f}x the measured read"
    )
    if bandwidth:
        floor = nbytes / bandwidth
        print(
            f"one read at {bandwidth / 1e9:.0f} GB/s: {floor * 1e3:.2f} ms; roots = {hashing / floor:.2f}x (goal: 1.5x)"
        )


def summarize_trace(where: str, top: int = 25) -> None:
    """The events of a ``jax.profiler`` trace with the most time, per process and line
    (a device's modules and its operations; on the host, inclusive Python frames). The
    trace is also copied to ``<where>.trace.json.gz``, one file beside the folder."""
    paths = glob.glob(os.path.join(where, "plugins", "profile", "*", "*trace.json.gz"))
    if not paths:
        print("  (no trace written)")
        return
    path = max(paths, key=os.path.getmtime)
    shutil.copy(path, where + ".trace.json.gz")
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X":
            line = names.get(e["pid"], str(e["pid"]))
            if not line.startswith("/host"):
                line += " / " + threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
            totals[line][e["name"]] += e.get("dur", 0)
    for line, counter in sorted(totals.items()):
        print(f"  {line}:")
        for name, micros in counter.most_common(top):
            print(f"    {micros / 1e3:10.1f} ms  {name[:110]}")


def snapshots_in(first: int, end: int) -> int:
    """How many of the steps ``first`` to ``end - 1`` copy a snapshot to the host."""
    return sum(1 for step in range(first, end) if step % SNAPSHOT_INTERVAL == 0)


def print_steady(label: str, v: dict[str, Any], plain: float, steps: int) -> None:
    """The proof's rounds without a snapshot against plain ``jax.jit``, and what a
    snapshot added to the rounds that held one."""
    steady = [t for t, n in zip(v["times"], v["snapshots"], strict=True) if n == 0]
    held = [(t, n) for t, n in zip(v["times"], v["snapshots"], strict=True) if n]
    if not steady:
        print(f"{label}: every round held a snapshot; no steady round to report")
        return
    median = statistics.median(steady)
    print(
        f"{label}: rounds without a snapshot {median * 1e3:.1f} ms/step = "
        f"{median / plain:.3f}x plain jax.jit ({len(steady)} of {len(v['times'])} rounds)"
    )
    if held:
        extra = statistics.median((t - median) * steps / n for t, n in held)
        print(
            f"{label}: a snapshot adds {extra * 1e3:.0f} ms, "
            f"{extra / SNAPSHOT_INTERVAL * 1e3:.1f} ms a step at interval {SNAPSHOT_INTERVAL}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--policies", default="0,0.01")
    parser.add_argument("--profile", default="")
    parser.add_argument("--stack-limit", type=int, default=None)
    parser.add_argument("--compare-stack-limits", default="")
    args = parser.parse_args()
    with stack_limit(args.stack_limit) as default_limit:
        run(args, default_limit)


def run(args: argparse.Namespace, default_limit: int) -> None:
    """The bench, its canonical updates stacking leaves of up to ``default_limit``."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="xla-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    device = jax.devices()[0]
    model, params, batch, length = workload(args.tiny)
    count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    print(
        f"canonical update: leaves of up to {default_limit} elements stacked by shape; "
        f"device: {device.device_kind} ({device.platform}), JAX {jax.__version__}; "
        f"model: {count / 1e6:.1f}M parameters, bf16 compute, {batch} x {length} tokens"
    )
    rng = np.random.default_rng(0)
    data = [
        jnp.asarray(rng.integers(0, model.vocab, (batch, length + 1)), jnp.int32) for _ in range(16)
    ]
    tx = optax.adamw(3e-4, weight_decay=0.1)
    root = tempfile.mkdtemp(prefix="tpu-overhead-")
    variants: dict[str, dict[str, Any]] = {}
    cases: list[tuple[str, float | None, int]] = [("jax.jit", None, default_limit)]
    for policy in args.policies.split(","):
        cases.append((f"proof.jit p={policy}", float(policy), default_limit))
    for limit in filter(None, args.compare_stack_limits.split(",")):
        cases.append((f"p=0, stack<={int(limit)}", 0.0, int(limit)))
    for label, probability, limit in cases:
        proof = None
        if probability is None:
            step = jax.jit(train_step, donate_argnums=(0,))
        else:
            proof = zkdv.jax.ZKDV(
                os.path.join(root, label.replace(" ", "-")),
                zkdv.ZKDVConfig(
                    sampling_policy=zkdv.SamplingPolicy(update_check_probability=probability)
                ),
                replay_snapshot_interval=SNAPSHOT_INTERVAL,
            )
            proof.start(rolling_window=4)
            step = proof.jit(train_step, donate_argnums=(0,))
        state = TrainState.create(proof=proof, apply_fn=model.apply, params=params, tx=tx)
        state = jax.tree.map(jnp.array, state)
        variants[label] = {
            "proof": proof,
            "step": step,
            "state": state,
            "times": [],
            "snapshots": [],
            "i": 0,
            "limit": limit,
        }

    def block(v: dict[str, Any], steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            v["state"] = v["step"](v["state"], data[v["i"] % len(data)])
            v["i"] += 1
        jax.block_until_ready(v["state"])
        if v["proof"] is not None:
            v["proof"].join()
        return (time.perf_counter() - start) / steps

    compiles = CompileLog()
    for label, v in variants.items():  # compile and warm up
        if label == "proof.jit p=0":  # the commitment alone first: a run cut short still has it
            measure_commitment(variants["jax.jit"]["state"], device)
        # The canonical program is built at a proof's first step, with this limit.
        started, count = time.perf_counter(), len(compiles.seconds)
        with stack_limit(v["limit"]):
            block(v, 2)
        print(
            f"{label}: first two steps {time.perf_counter() - started:.1f} s; "
            f"{compiles.since(count)}",
            flush=True,
        )
    for r in range(args.rounds):
        for v in variants.values():
            first = v["i"]
            v["snapshots"].append(snapshots_in(first, first + args.steps))
            v["times"].append(block(v, args.steps))
        row = ", ".join(f"{label} {v['times'][-1] * 1e3:.1f}" for label, v in variants.items())
        print(f"round {r + 1} (ms/step): {row}", flush=True)
    plain = statistics.median(variants["jax.jit"]["times"])
    print(f"\n{'variant':<24} {'ms/step (median)':>18} {'ratio':>8}   rounds")
    for label, v in variants.items():
        median = statistics.median(v["times"])
        rounds = " ".join(f"{t * 1e3:.1f}" for t in v["times"])
        print(f"{label:<24} {median * 1e3:>18.2f} {median / plain:>8.3f}   {rounds}")
    for label, v in variants.items():
        if v["proof"] is not None:
            goal = " (goal at p=0: 1.05x)" if label == "proof.jit p=0" else ""
            ratio = statistics.median(v["times"]) / plain
            print(f"{label}: {ratio:.3f}x plain jax.jit{goal}")
            print_steady(label, v, plain, args.steps)

    for label, v in variants.items():
        if v["proof"] is not None:
            totals = v["proof"].transfers.totals()
            per_step = ", ".join(f"{k} {b / v['i'] / 2**20:.2f}" for k, b in sorted(totals.items()))
            print(f"{label}: read from the device, MiB per step over {v['i']} steps: {per_step}")
    if args.profile:
        steps = min(args.steps, 4)
        for label, v in variants.items():
            where = os.path.join(args.profile, re.sub(r"[^A-Za-z0-9._-]+", "-", label))
            with jax.profiler.trace(where, create_perfetto_trace=True):
                block(v, steps)
            print(f"\n{label}: profile of {steps} steps in {where}")
            summarize_trace(where)
    for v in variants.values():
        if v["proof"] is not None:
            v["proof"].close()


if __name__ == "__main__":
    main()
