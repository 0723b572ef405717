"""Where the device chunk roots of a real model's state spend their time, stage by stage.

    python scripts/tpu/roots_stages.py [--tiny] [--repeat 10] [--stages all] [--interpret]
        [--chunk-kib 1024]

``bench/tpu_overhead.py`` measured the chunk roots of its 135M-parameter model's state
(592 leaves, 1,550 MiB: parameters and AdamW's two moments) at 104 ms on a v5e, where
the Pallas kernels hash 1 GiB in 4.3 ms (``hash_layouts.py``). This times the pipeline
of :func:`zkdv.jax.device_merkle.chunk_roots` (``KERNEL``) on that state's layout (random
words of the same shapes and dtypes), each stage a program of its own over the previous
stage's output, so the rows add up to about the whole:

* ``read``: one read of the state (an XOR over every word), the floor;
* ``rows``: the leaves' words concatenated into the bulk and odd matrices of message
  words (``zkdv.device_merkle._chunk_rows``: every full Merkle chunk's BLAKE3 chunks,
  then the odd chunks);
* ``tiles``: the bulk matrix transposed to word-major ``(256, R, 128)`` int32 and padded
  to whole kernel invocations (what the chunk kernel reads);
* ``kernel``: the chunk kernel alone on those tiles;
* ``levels``: the bulk subtrees' parent levels on its chaining values;
* ``odd``: the odd chunks' transpose and kernel;
* ``roots``: the whole ``chunk_roots``, and its roots checked against the host's.

``--tiny`` uses the bench's ``--tiny`` model, so that the script can be checked on a CPU
(``--interpret`` there: the kernels through Pallas's interpreter; ``--chunk-kib 16``, so
that its small leaves have full Merkle chunks); its numbers mean nothing for a TPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import tpu_overhead
from hash_layouts import timed  # this script's folder: the same timing

from zkdv import device_merkle as dm
from zkdv.hashing import Domain
from zkdv.jax import _blake3_kernel as kernels
from zkdv.jax.device_merkle import KERNEL, JaxOps, chunk_roots, leaf_words
from zkdv.merkle import commit_state

STAGES = ("read", "rows", "tiles", "kernel", "levels", "odd", "roots")


def state_shapes(tiny: bool) -> list[jax.ShapeDtypeStruct]:
    """The bench model's parameters and AdamW state, as shapes (nothing computed)."""
    model, _, length = tpu_overhead.model_for(tiny)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    )
    opt = jax.eval_shape(optax.adamw(3e-4).init, params)
    return [leaf for leaf in jax.tree.leaves((params, opt)) if leaf.size]


def random_state(shapes: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    key = jax.random.key(1)
    out = []
    for i, spec in enumerate(shapes):
        words = jax.random.bits(jax.random.fold_in(key, i), spec.shape, jnp.uint32)
        if np.dtype(spec.dtype).itemsize == 4:
            out.append(jax.lax.bitcast_convert_type(words, spec.dtype))
        else:  # small leaves of other widths (a step counter): plain values
            out.append(jnp.zeros(spec.shape, spec.dtype))
    return out


def stage_programs(plan: dm.HashPlan, interpret: bool) -> dict[str, Callable[..., Any]]:
    """Each stage as a jitted function of the previous stage's output."""
    ops = JaxOps(unroll=False, kernel=True)
    key = dm.key_words(Domain.LEAF)
    per, nbulk = plan.per_message, plan.bulk_messages
    count = nbulk * per
    rows = kernels._rows_for(count)

    def read(leaves: list[jax.Array]) -> jax.Array:
        total = jnp.uint32(0)
        for leaf in leaves:
            total = total ^ jax.lax.reduce(
                leaf_words(leaf), jnp.uint32(0), jax.lax.bitwise_xor, (0,)
            )
        return total

    def to_rows(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        return dm._chunk_rows(ops, plan, [leaf_words(leaf) for leaf in leaves])

    def tiles(bulk: jax.Array) -> jax.Array:
        return kernels._tiles(jax.lax.bitcast_convert_type(bulk, jnp.int32).T, rows)

    def kernel(words: jax.Array) -> jax.Array:
        chunk = functools.partial(kernels._chunk_kernel, key, per, rows, not interpret)
        return kernels._call(chunk, [words], rows, interpret).reshape(8, -1)[:, :count]

    def levels(cv: jax.Array) -> jax.Array:
        cv = cv.reshape(8, nbulk, per)
        while cv.shape[2] > 1:
            half = cv.shape[2] // 2
            pairs = cv.reshape(8, nbulk * half, 2)
            cv = kernels.parents(pairs[:, :, 0], pairs[:, :, 1], key, interpret)
            cv = cv.reshape(8, nbulk, half)
        return cv

    def odd(matrix: jax.Array) -> jax.Array:
        tables = jnp.asarray(
            np.stack([plan.odd_counter, plan.odd_length, plan.odd_root]).astype(np.int32)
        )
        return kernels._odd(matrix, tables, key, interpret)

    return {
        name: jax.jit(fn)
        for name, fn in (
            ("read", read),
            ("rows", to_rows),
            ("tiles", tiles),
            ("kernel", kernel),
            ("levels", levels),
            ("odd", odd),
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--stages", default="all")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--chunk-kib", type=int, default=1024)
    args = parser.parse_args()
    stages = STAGES if args.stages == "all" else tuple(args.stages.split(","))
    shapes = state_shapes(args.tiny)
    leaves = random_state(shapes)
    nbytes = sum(leaf.nbytes for leaf in leaves)
    chunk_bytes = args.chunk_kib * 1024
    plan = dm.HashPlan.build([leaf.nbytes for leaf in leaves], chunk_bytes)
    print(
        f"{jax.devices()[0].device_kind}: {len(leaves)} leaves, {nbytes / 2**20:.0f} MiB; "
        f"{plan.bulk_messages} bulk Merkle chunks, {len(plan.odd_counter)} odd BLAKE3 chunks",
        flush=True,
    )
    programs = stage_programs(plan, args.interpret)
    values: dict[str, Any] = {}
    inputs = {
        "read": lambda: programs["read"](leaves),
        "rows": lambda: programs["rows"](leaves),
        "tiles": lambda: programs["tiles"](values["rows"][0]),
        "kernel": lambda: programs["kernel"](values["tiles"]),
        "levels": lambda: programs["levels"](values["kernel"]),
        "odd": lambda: programs["odd"](values["rows"][1]),
        "roots": lambda: chunk_roots(leaves, chunk_bytes, schedule=KERNEL),
    }
    needs = {"tiles": "rows", "kernel": "tiles", "levels": "kernel", "odd": "rows"}
    total = 0.0
    for name in STAGES:
        wanted = name in stages or any(needs.get(s) == name for s in stages)
        if not wanted or (name in needs and needs[name] not in values):
            continue
        first, run, values[name] = timed(inputs[name], args.repeat)
        if name not in ("read", "roots"):
            total += run
        note = ""
        if name == "roots":
            host = [(str(i), np.asarray(leaf)) for i, leaf in enumerate(leaves)]
            want = list(commit_state(host, chunk_bytes).chunk_roots)
            same = dm.roots_to_bytes(np.asarray(values[name])) == want
            note = f"; stages above: {total * 1e3:.2f} ms; " + (
                "every root equals the host's" if same else "ROOTS DIFFER"
            )
        print(
            f"{name:>7}: {run * 1e3:9.2f} ms  ({nbytes / run / 1e9:6.1f} GB/s of state), "
            f"first call {first:6.1f} s{note}",
            flush=True,
        )


if __name__ == "__main__":
    main()
