"""Where the device chunk roots of a real model's state spend their time, stage by stage.

    python scripts/tpu/roots_stages.py [--tiny] [--repeat 10] [--stages all] [--interpret]
        [--chunk-kib 1024] [--rows 16,32]

This times the pipeline of :func:`zkdv.jax.device_merkle.chunk_roots` (``KERNEL``) on
the state of ``bench/tpu_overhead.py``'s 135M-parameter model (592 leaves, 1,550 MiB:
parameters and AdamW's two moments; random words of the same shapes and dtypes), each
stage a program of its own over the leaves:

* ``read``: one read of the state (an XOR over every word), the floor;
* ``tiles``: every leaf's full Merkle chunks transposed into the bulk kernel's word-major
  layout and concatenated (``_blake3_kernel._leaf_tiles``), the copy the kernel reads;
* ``bulk``: ``_blake3_kernel.bulk_roots``: those tiles, the kernel (compression and the
  subtrees' first levels) and the levels above it;
* ``odd``: the odd chunks (each message's one-byte tail, the partial Merkle chunks):
  their rows (``zkdv.device_merkle._chunk_rows``) and kernel;
* ``roots``: the whole ``chunk_roots``, and its roots checked against the host's.

``--rows`` times the bulk kernel at each number of sublane rows (``BULK_ROWS``).
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
from zkdv.jax import device_merkle
from zkdv.jax.device_merkle import KERNEL, JaxOps, chunk_roots, leaf_words
from zkdv.merkle import commit_state

STAGES = ("read", "tiles", "bulk", "odd", "roots")


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
    """Each stage as a jitted function of the leaves."""
    ops = JaxOps(unroll=False, kernel=True)
    key = dm.key_words(Domain.LEAF)
    per = plan.per_message
    full = [i for i, leaf in enumerate(plan.leaves) if leaf.full]

    def read(leaves: list[jax.Array]) -> jax.Array:
        total = jnp.uint32(0)
        for leaf in leaves:
            total = total ^ jax.lax.reduce(
                leaf_words(leaf), jnp.uint32(0), jax.lax.bitwise_xor, (0,)
            )
        return total

    def tiles(leaves: list[jax.Array]) -> jax.Array:
        rows = kernels.BULK_ROWS
        unit = max(rows * 128, per)
        out = []
        for i in full:
            n = plan.leaves[i].full * per
            padded = -(-n // unit) * unit
            words = leaf_words(leaves[i])
            out.append(kernels._leaf_tiles(words, n, padded, per, rows)[0])
        return jnp.concatenate(out, axis=1)

    def bulk(leaves: list[jax.Array]) -> list[jax.Array]:
        words = [leaf_words(leaves[i]) for i in full]
        return kernels.bulk_roots(words, [plan.leaves[i].full for i in full], key, per)

    def odd(leaves: list[jax.Array]) -> jax.Array:
        words = [leaf_words(leaf) for leaf in leaves]
        width = plan.chunk_bytes // 4
        # each bulk message's last data word, as the bulk kernel hands it on
        last = [words[i][: plan.leaves[i].full * width].reshape(-1, width)[:, -1] for i in full]
        _, matrix = dm._chunk_rows(ops, plan, words, last=jnp.concatenate(last) if last else None)
        tables = jnp.asarray(
            np.stack([plan.odd_counter, plan.odd_length, plan.odd_root]).astype(np.int32)
        )
        return kernels._odd(matrix, tables, key, interpret)

    return {
        name: jax.jit(fn)
        for name, fn in (("read", read), ("tiles", tiles), ("bulk", bulk), ("odd", odd))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--stages", default="all")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--rows", default="16", help="kernels.BULK_ROWS to time, comma-separated")
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
    for rows in args.rows.split(","):
        kernels.BULK_ROWS = int(rows)
        device_merkle._program.cache_clear()
        print(f"-- {rows} rows", flush=True)
        run_stages(stage_programs(plan, args.interpret), leaves, stages, chunk_bytes, args)


def run_stages(
    programs: dict[str, Callable[..., Any]],
    leaves: list[jax.Array],
    stages: tuple[str, ...],
    chunk_bytes: int,
    args: argparse.Namespace,
) -> None:
    nbytes = sum(leaf.nbytes for leaf in leaves)
    total = 0.0
    for name in stages:
        if name == "roots":
            fn = lambda: chunk_roots(leaves, chunk_bytes, schedule=KERNEL)  # noqa: E731
        else:
            fn = functools.partial(programs[name], leaves)
        first, run, value = timed(fn, args.repeat)
        if name in ("bulk", "odd"):
            total += run
        note = ""
        if name == "roots":
            host = [(str(i), np.asarray(leaf)) for i, leaf in enumerate(leaves)]
            want = list(commit_state(host, chunk_bytes).chunk_roots)
            same = dm.roots_to_bytes(np.asarray(value)) == want
            note = f"; bulk + odd: {total * 1e3:.2f} ms; " + (
                "every root equals the host's" if same else "ROOTS DIFFER"
            )
        print(
            f"{name:>7}: {run * 1e3:9.2f} ms  ({nbytes / run / 1e9:6.1f} GB/s of state), "
            f"first call {first:6.1f} s{note}",
            flush=True,
        )


if __name__ == "__main__":
    main()
