"""Flax NNX and ``zkdv.jax.scan`` under ZKDV, side by side with plain JAX in one run.

    python bench/jax_nnx_scan.py [--rounds 3] [--calls 16] [--only nnx|scan] [--width 512]

* ``nnx``: the Flax guide's step (``nnx.value_and_grad``, ``optimizer.update``) on an
  MLP with BatchNorm and Dropout, AdamW, model and optimizer donated: ``nnx.jit`` versus
  ``proof.jit``. Also prints how long the NNX adaptor's host work takes per step
  (splitting the objects and updating them in place).
* ``scan``: K = 8 updates per compiled call of a Flax ``TrainState`` MLP, AdamW:
  ``jax.jit`` of ``jax.lax.scan`` versus ``proof.jit`` of ``zkdv.jax.scan``, which
  commits each update's gradient and applies the canonical update inside the loop;
  the same scan without the gradient commit (a state with ``attest_apply_fn``, which
  keeps the version-1 path: plain update, no gradient); and ``proof.jit`` of one update
  per call for reference.

Proofs run without sampled checks (``update_check_probability=0``), so what is measured
is the per-update cost of committing. Variants run in interleaved blocks; a proof's
block ends with ``proof.join()``, so its commitments are inside the timing. Reported:
median wall and process CPU time per update (all threads; on a shared machine the wall
clock mostly measures the neighbours).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("ZKDV_JAX_EXPORT_PLATFORMS", "")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx

import zkdv
from zkdv.jax.contrib import TrainState
from zkdv.jax.graphs import split_graph

K = 8
FEATURES, CLASSES, ROWS = 256, 10, 64
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))


def _data(count: int, leading: tuple[int, ...] = ()) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    shape = (*leading, ROWS)
    return [
        jnp.asarray(
            np.concatenate(
                [rng.standard_normal((*shape, FEATURES)), rng.integers(0, CLASSES, (*shape, 1))],
                axis=-1,
            ),
            jnp.float32,
        )
        for _ in range(count)
    ]


def _cross_entropy(logits: jax.Array, batch: jax.Array) -> jax.Array:
    labels = batch[:, FEATURES].astype(jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _timed(block: Callable[[], Any], updates: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    block()
    return (
        (time.perf_counter() - wall) / updates * 1e3,
        (time.process_time() - cpu) / updates * 1e3,
    )


def _report(name: str, results: dict[str, list[tuple[float, float]]], base: str) -> None:
    print(f"[{name}] ms per update, median of {len(results[base])} rounds")
    wall0 = statistics.median(w for w, _ in results[base])
    cpu0 = statistics.median(c for _, c in results[base])
    for variant, samples in results.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(
            f"  {variant:24s} {wall:8.2f} wall (ratio {wall / wall0:6.3f})"
            f"  {cpu:8.2f} cpu (ratio {cpu / cpu0:6.3f})"
        )


# -- nnx -------------------------------------------------------------------------------
class MLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(FEATURES, width, rngs=rngs)
        self.norm = nnx.BatchNorm(width, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(width, width, rngs=rngs)
        self.linear3 = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.dropout(jax.nn.relu(self.norm(self.linear1(x))))
        return self.linear3(jax.nn.relu(self.linear2(x)))


def nnx_step(model: MLP, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return _cross_entropy(model(batch[:, :FEATURES]), batch)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def bench_nnx(rounds: int, calls: int, width: int) -> None:
    data = _data(8)
    results: dict[str, list[tuple[float, float]]] = {}
    adaptor: list[float] = []
    for _ in range(rounds):
        model = MLP(width, nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        plain = nnx.jit(nnx_step, donate_argnames=("model", "optimizer"))
        for batch in data[:2]:
            plain(model, optimizer, batch)

        def plain_block(plain: Any = plain, model: Any = model, optimizer: Any = optimizer) -> None:
            for i in range(calls):
                loss = plain(model, optimizer, data[i % 8])
            jax.block_until_ready(loss)

        results.setdefault("nnx.jit", []).append(_timed(plain_block, calls))
        with tempfile.TemporaryDirectory() as directory:
            proof = zkdv.jax.ZKDV(directory, NO_CHECKS)
            proof.start(rolling_window=4, probe_ratio=0.01)
            model = MLP(width, nnx.Rngs(0, dropout=1))
            optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
            step = proof.jit(nnx_step, donate_argnames=("model", "optimizer"))
            for batch in data[:2]:
                step(model, optimizer, batch)
            proof.join()

            def proof_block(
                step: Any = step, model: Any = model, optimizer: Any = optimizer, proof: Any = proof
            ) -> None:
                for i in range(calls):
                    step(model, optimizer, data[i % 8])
                proof.join()

            results.setdefault("proof.jit", []).append(_timed(proof_block, calls))
            start = time.perf_counter()
            for _ in range(calls):
                # What the adaptor does around each call: split both objects, then set
                # their variables to the step's outputs.
                for node in (model, optimizer):
                    graph = split_graph(node)
                    assert graph.variables is not None
                    for variable, value in zip(
                        graph.variables, jax.tree.leaves(graph.state), strict=True
                    ):
                        variable.set_value(value)
            adaptor.append((time.perf_counter() - start) / calls * 1e3)
            proof.close()
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} cpus")
    _report(f"nnx {params / 1e6:.2f}M params, batch {ROWS}", results, "nnx.jit")
    print(
        f"  NNX adaptor host work (split both objects, set their variables): "
        f"{statistics.median(adaptor):.2f} ms per step"
    )


# -- scan ------------------------------------------------------------------------------
class LinenMLP(linen.Module):
    width: int

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(linen.Dense(self.width)(x))
        return linen.Dense(CLASSES)(jax.nn.relu(linen.Dense(self.width)(x)))


def _update(state: Any, batch: jax.Array) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
        return _cross_entropy(state.apply_fn({"params": params}, batch[:, :FEATURES]), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def scan_steps(state: Any, xs: jax.Array) -> Any:
    return zkdv.jax.scan(_update, state, xs)  # jax.lax.scan outside proof.jit


def one_step(state: Any, xs: jax.Array) -> Any:
    return _update(state, xs[0])


def bench_scan(rounds: int, calls: int, width: int) -> None:
    model = LinenMLP(width)
    initial = jax.tree.map(
        np.asarray, model.init(jax.random.key(0), jnp.ones((1, FEATURES)))["params"]
    )
    stacked, single = _data(4, (K,)), _data(4, (1,))
    # (name, step, data, proved, commits its gradients)
    variants: list[tuple[str, Callable[..., Any], list[jax.Array], bool, bool]] = [
        ("jax.jit, lax.scan", scan_steps, stacked, False, False),
        ("proof.jit, zkdv.jax.scan", scan_steps, stacked, True, True),
        ("zkdv.jax.scan, no gradient", scan_steps, stacked, True, False),
        ("proof.jit, one per call", one_step, single, True, True),
    ]
    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for name, function, data, proved, commits in variants:
            with tempfile.TemporaryDirectory() as directory:
                proof = zkdv.jax.ZKDV(directory, NO_CHECKS) if proved else None
                if proof is not None:
                    proof.start(rolling_window=4, probe_ratio=0.01)
                state = TrainState.create(
                    proof=proof,
                    apply_fn=model.apply,
                    params=jax.tree.map(jnp.asarray, initial),
                    tx=optax.adamw(1e-3),
                    # The same function: only the path it selects differs.
                    attest_apply_fn=None if commits or not proved else model.apply,
                )
                compile_ = proof.jit if proof is not None else jax.jit
                step = compile_(function, donate_argnums=(0,))
                for batch in data[:2]:
                    state, _ = step(state, batch)
                if proof is not None:
                    proof.join()
                box = [state]

                def block(
                    step: Any = step,
                    box: list[Any] = box,
                    proof: Any = proof,
                    data: list[jax.Array] = data,
                ) -> None:
                    calls_made = calls * K // data[0].shape[0]
                    for i in range(calls_made):
                        box[0], loss = step(box[0], data[i % 4])
                    jax.block_until_ready(loss)
                    if proof is not None:
                        proof.join()

                results.setdefault(name, []).append(_timed(block, calls * K))
                if proof is not None:
                    proof.close()
    params = sum(x.size for x in jax.tree.leaves(initial))
    _report(
        f"scan {params / 1e6:.2f}M params, batch {ROWS}, {K} updates per call",
        results,
        "jax.jit, lax.scan",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=16, help="scan calls (K updates each)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--only", choices=("nnx", "scan"))
    args = parser.parse_args()
    if args.only in (None, "nnx"):
        bench_nnx(args.rounds, args.calls * K // 2, args.width)
    if args.only in (None, "scan"):
        bench_scan(args.rounds, args.calls, args.width)


if __name__ == "__main__":
    main()
