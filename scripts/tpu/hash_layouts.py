"""Where the device chunk roots' time goes on a TPU, and which layout of BLAKE3 fixes it.

    python scripts/tpu/hash_layouts.py [--mib 256] [--variants all]

The bulk of the state commitment is BLAKE3's chunk compression: 16 blocks of every
1 KiB chunk of the state (``zkdv.device_merkle``, step 1). The library lays a batch of
chunks out as ``(chunks, 256)`` words and holds BLAKE3's state as four stacked rows
(``(4, chunks)``); on a v5e that ran at 5 GB/s (155x one read of the state). Variants,
each timed (compile and run) on the same chunks, each checked bit for bit against the
numpy reference on a sample:

* ``library``: ``zkdv.jax.device_merkle.chunk_roots`` on leaves of the same bytes
  (whole pipeline: bulk, subtrees, Merkle trees), schedule ``--schedule``, every root
  checked against the host's;
* ``rows``: the library's bulk compression alone (``_chunk_batch`` through ``JaxOps``,
  the ``BLOCKWISE`` schedule);
* ``words``: word-major (``(256, R, 128)``), sixteen separate word arrays of full
  (8, 128) tiles, one block's compression fused, the blocks a loop;
* ``pallas-T`` (``pallas-Tu``: its 16 blocks unrolled): a Pallas kernel over word-major tiles of ``T`` x 128 chunks, all 16
  blocks in one kernel invocation (the chaining value never leaves the core);
* ``compute-T``: ``pallas-T`` reading one block for every invocation: the compression's
  time without HBM traffic, the roof of any layout (the v5e's vector unit, not its
  memory, bounds BLAKE3 if this is close to ``pallas-T``);
* ``levels-pairs``, ``levels-halves``: the subtree levels alone (on the first eight
  words of each chunk as its chaining value), pairing neighbours as the library does or
  taking contiguous halves, as a bit-reversed chunk order would allow;
* ``transpose``: the ``(chunks, 256) -> (256, chunks)`` transpose the word-major forms
  need, alone;
* ``read``: one read of the same bytes (an XOR over every word): the floor.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv import device_merkle as dm
from zkdv.hashing import Domain
from zkdv.jax._blake3_kernel import _i32, compress

KEY = dm.key_words(Domain.LEAF)
PER = 1024  # BLAKE3 chunks per 1 MiB Merkle chunk


def _flags(j: Any, dtype: Any) -> Any:
    start = jnp.where(j == 0, dm.CHUNK_START, 0)
    end = jnp.where(j == 15, dm.CHUNK_END, 0)
    return (dm.KEYED_HASH | start | end).astype(dtype)


def words_cvs(t: jax.Array) -> list[jax.Array]:
    """Word-major ``(256, R, 128)`` int32 chunks -> eight ``(R, 128)`` chaining words."""
    shape = t.shape[1:]
    iota = lax.broadcasted_iota
    counter = (iota(jnp.int32, shape, 0) * 128 + iota(jnp.int32, shape, 1)) & (PER - 1)
    init = tuple(jnp.full(shape, _i32(k), jnp.int32) for k in KEY)

    def block(j: Any, cv: tuple[Any, ...]) -> tuple[Any, ...]:
        m = [lax.dynamic_index_in_dim(t, j * 16 + w, 0, keepdims=False) for w in range(16)]
        return tuple(compress(cv, m, counter, 64, _flags(j, jnp.int32)))

    return list(lax.fori_loop(0, 16, block, init))


def pallas_cvs(
    t: jax.Array,
    rows: int,
    unroll: bool = False,
    interpret: bool = False,
    same_block: bool = False,
) -> jax.Array:
    """Word-major ``(256, R, 128)`` int32 chunks -> ``(8, R, 128)`` chaining words, one
    kernel invocation per ``rows`` x 128 chunks, all 16 blocks inside it.

    ``same_block``: every invocation reads the first block (Pallas fetches a block only
    when its index changes), so the time is the compression's alone, without HBM: the
    compute roof that hashing the state cannot beat."""
    from jax.experimental import pallas as pl

    total = t.shape[1]

    def kernel(x_ref: Any, o_ref: Any) -> None:
        base = pl.program_id(0) * (rows * 128)
        shape = (rows, 128)
        index = (
            base
            + lax.broadcasted_iota(jnp.int32, shape, 0) * 128
            + lax.broadcasted_iota(jnp.int32, shape, 1)
        )
        counter = index & (PER - 1)
        cv = tuple(jnp.full(shape, _i32(k), jnp.int32) for k in KEY)

        def block(j: Any, cv: tuple[Any, ...]) -> tuple[Any, ...]:
            m = [x_ref[j * 16 + w] for w in range(16)]
            return tuple(compress(cv, m, counter, 64, _flags(j, jnp.int32), unroll=not interpret))

        cv = lax.fori_loop(0, 16, block, cv, unroll=unroll)
        for i in range(8):
            o_ref[i] = cv[i]

    return pl.pallas_call(
        kernel,
        grid=(total // rows,),
        in_specs=[pl.BlockSpec((256, rows, 128), lambda i: (0, 0 if same_block else i, 0))],
        out_specs=pl.BlockSpec((8, rows, 128), lambda i: (0, i, 0)),
        out_shape=jax.ShapeDtypeStruct((8, total, 128), jnp.int32),
        interpret=interpret,
    )(t)


def reference(natural: np.ndarray, first: int, count: int) -> np.ndarray:
    """Chaining values of chunks ``first .. first + count`` by the numpy reference."""
    ops = dm.NumpyOps()
    matrix = natural[first : first + count]
    counter = ((np.arange(first, first + count)) % PER).astype(np.uint32)

    def params(j: int) -> tuple[Any, Any, Any, Any]:
        flags = np.uint32(
            dm.KEYED_HASH | (dm.CHUNK_START if j == 0 else 0) | (dm.CHUNK_END if j == 15 else 0)
        )
        return counter, np.uint32(64), flags, None

    with np.errstate(over="ignore"):
        cv = dm._chunk_batch(ops, matrix, [np.uint32(k) for k in KEY], 16, params, count)
    return np.stack(cv)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return first, (time.perf_counter() - start) / repeats, out


def measure(
    name: str, natural: jax.Array, args: argparse.Namespace, check: Callable[[np.ndarray], str]
) -> tuple[float, float, str]:
    """Compile and run variant ``name`` on the ``(chunks, 256)`` words: (first call, run, verdict)."""
    chunks = natural.shape[0]
    if name == "read":
        fn = jax.jit(lambda x: lax.reduce(x, jnp.uint32(0), lax.bitwise_xor, (0, 1)))
        first, run, _ = timed(lambda: fn(natural), args.repeat)
        return first, run, ""
    if name == "transpose":
        fn = jax.jit(lambda x: x.T.reshape(256, -1, 128))
        first, run, _ = timed(lambda: fn(natural), args.repeat)
        return first, run, ""
    if name == "words":
        fn = jax.jit(
            lambda x: jnp.stack(
                words_cvs(lax.bitcast_convert_type(x.T.reshape(256, -1, 128), jnp.int32))
            )
        )
        first, run, out = timed(lambda: fn(natural), args.repeat)
        return first, run, check(np.asarray(out).view(np.uint32).reshape(8, -1))
    if name.startswith(("pallas-", "compute-")):
        rows = int(name.split("-")[1].rstrip("u"))
        same = name.startswith("compute-")
        t = jax.jit(lambda x: lax.bitcast_convert_type(x.T.reshape(256, -1, 128), jnp.int32))(
            natural
        )
        fn = jax.jit(
            functools.partial(
                pallas_cvs,
                rows=rows,
                unroll=name.endswith("u"),
                interpret=args.interpret,
                same_block=same,
            )
        )
        first, run, out = timed(lambda: fn(t), args.repeat)
        if same:  # only the first block's values are this data's
            return first, run, "compression alone (one block read)"
        return first, run, check(np.asarray(out).view(np.uint32).reshape(8, -1))
    if name == "rows":
        from zkdv.jax.device_merkle import BLOCKWISE, JaxOps

        s = BLOCKWISE
        ops = JaxOps(unroll=s.unroll, exact_levels=s.exact_levels, unroll_blocks=s.unroll_blocks)
        counter = jnp.asarray((np.arange(chunks) % PER).astype(np.uint32))

        def params(j: Any) -> tuple[Any, Any, Any, Any]:
            flags = ops.const(dm.KEYED_HASH) | ops.flag(j == 0, dm.CHUNK_START)
            return counter, ops.const(64), flags | ops.flag(j == 15, dm.CHUNK_END), None

        fn = jax.jit(
            lambda x: jnp.stack(
                dm._chunk_batch(ops, x, [ops.const(k) for k in KEY], 16, params, chunks)
            )
        )
        first, run, out = timed(lambda: fn(natural), args.repeat)
        return first, run, check(np.asarray(out))
    if name == "library":
        from zkdv.jax import device_merkle as dm_jax
        from zkdv.jax.device_merkle import chunk_roots

        size = min(4096, chunks)  # 4 MiB leaves
        leaves = [
            lax.bitcast_convert_type(natural[i : i + size], jnp.float32)
            for i in range(0, chunks, size)
        ]
        schedule = getattr(dm_jax, args.schedule)
        first, run, out = timed(
            lambda: chunk_roots(leaves, 1 << 20, schedule=schedule), args.repeat
        )
        roots = dm.roots_to_bytes(np.asarray(out))
        import zkdv.merkle

        host_leaves = [(str(i), np.asarray(leaf)) for i, leaf in enumerate(leaves)]
        want = list(zkdv.merkle.commit_state(host_leaves, 1 << 20).chunk_roots)
        return first, run, "every root equals the host's" if roots == want else "ROOTS DIFFER"
    if name.startswith("levels-"):
        return _levels(name, natural, args)
    raise SystemExit(f"unknown variant {name}")


def _levels(name: str, natural: jax.Array, args: argparse.Namespace) -> tuple[float, float, str]:
    """The subtree levels alone, on chaining values of ``per = 1024`` chunks a message:
    ``levels-pairs`` pairs neighbours as the library does (``(8, n, 2)`` arrays), and
    ``levels-halves`` takes each level's children as the two contiguous halves (what a
    bit-reversed chunk order would give); both checked to give the same roots."""
    from zkdv.jax import _blake3_kernel as bk

    key = tuple(int(k) for k in KEY)
    nbulk = natural.shape[0] // PER
    cv = lax.bitcast_convert_type(natural[:, :8].T, jnp.int32).reshape(8, nbulk, PER)

    def reduce(cv: jax.Array, halves: bool) -> jax.Array:
        while cv.shape[2] > 1:
            half = cv.shape[2] // 2
            n = nbulk * half
            if halves:
                left, right = cv[:, :, :half].reshape(8, n), cv[:, :, half:].reshape(8, n)
            else:
                pairs = cv.reshape(8, n, 2)
                left, right = pairs[:, :, 0], pairs[:, :, 1]
            cv = bk.parents(left, right, key, args.interpret).reshape(8, nbulk, half)
        return cv.reshape(8, nbulk)

    halves = name == "levels-halves"
    fn = jax.jit(functools.partial(reduce, halves=halves))
    bits = PER.bit_length() - 1
    reverse = np.array([int(f"{p:0{bits}b}"[::-1], 2) for p in range(PER)])
    data = cv[:, :, reverse] if halves else cv
    first, run, out = timed(lambda: fn(data), args.repeat)
    want = jax.jit(functools.partial(reduce, halves=False))(cv)
    same = np.array_equal(np.asarray(out), np.asarray(want))
    return first, run, "roots equal the pairs' roots" if same else "ROOTS DIFFER"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="read,transpose,pallas-8,pallas-8u,pallas-16,pallas-32,words,rows,library,levels-pairs,levels-halves",
    )
    parser.add_argument("--schedule", default="KERNEL", help="the library variant's schedule")
    parser.add_argument(
        "--interpret", action="store_true", help="Pallas in interpret mode (a CPU check)"
    )
    args = parser.parse_args()
    chunks = args.mib * 1024
    device = jax.devices()[0]
    print(
        f"{device.device_kind} ({device.platform}), JAX {jax.__version__}; {args.mib} MiB = {chunks} BLAKE3 chunks",
        flush=True,
    )
    natural = jax.random.bits(jax.random.key(0), (chunks, 256), jnp.uint32)
    host = np.asarray(natural)
    sample = [(0, 256), (chunks - 256, 256)]
    expect = {s: reference(host, *s) for s in sample}
    nbytes = chunks * 1024

    def check(cv: np.ndarray) -> str:  # cv: (8, chunks) uint32
        ok = all(np.array_equal(cv[:, f : f + n], expect[(f, n)]) for f, n in sample)
        return "bits equal the reference" if ok else "BITS DIFFER"

    floor = None
    for name in args.variants.split(","):
        try:
            first, run, verdict = measure(name, natural, args, check)
        except Exception as error:  # a variant that does not compile is a result too
            print(f"{name:<12} failed: {type(error).__name__}: {str(error)[:600]}", flush=True)
            continue
        if name == "read":
            floor = run
        rate = nbytes / run / 1e9
        ratio = f" = {run / floor:.1f}x the read" if floor and name != "read" else ""
        print(
            f"{name:<12} first call {first:7.2f} s, then {run * 1e3:8.2f} ms ({rate:6.1f} GB/s){ratio} {verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
