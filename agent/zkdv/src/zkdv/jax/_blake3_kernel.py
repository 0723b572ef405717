"""The bulk of the device commitment as Pallas kernels: BLAKE3 over every full chunk.

Nearly all of a state's hashing is step 1 of :mod:`zkdv.device_merkle`: the 16 blocks of
every full 1 KiB BLAKE3 chunk, then the perfect subtrees over each Merkle chunk's
chunks. Written as ``jax.numpy`` array code (:class:`zkdv.jax.device_merkle.JaxOps`),
XLA's TPU compiler took 80 s over it for a 135M-parameter model and ran it at 5 GB/s,
155x one read of the state from HBM (``docs/reliability.md`` section 10). Here the same
arithmetic runs word-major: each leaf's data is transposed once so that each of a
block's sixteen message words is a whole ``(rows, 128)`` tile of chunks, BLAKE3's
sixteen state words are sixteen separate tiles (no stacked rows to shuffle), and one
kernel invocation compresses all 16 blocks of ``rows * 128`` chunks with the chaining
value in vector registers, builds the message words from the data words (the leaf
prefix's one-byte shift) as it reads them, and hashes the first levels of the chunks'
subtrees, whose neighbours it holds in neighbouring rows of the same lane. Measured on
a v5e: the kernel alone hashes at 255 GB/s, where it is compute-bound
(``scripts/tpu/hash_layouts.py``); the whole state's roots, with the transposes, the
odd chunks and the trees, at 39 GB/s (``scripts/tpu/roots_stages.py``).

The kernels compute in int32 (the same bits as uint32: addition wraps, shifts are
logical), which every Pallas backend supports. :func:`bulk_roots` lowers them for the
TPU through Mosaic and everywhere else through Pallas's interpreter (plain XLA), chosen
when the program is lowered (:func:`jax.lax.platform_dependent`), so the same program
exports for a TPU from a CPU and runs, slowly, in CPU tests.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from zkdv.device_merkle import (
    _PERMUTATION,
    BLOCK,
    CHUNK_END,
    CHUNK_START,
    CHUNK_WORDS,
    IV,
    KEYED_HASH,
    PARENT,
    ROOT,
)

__all__ = ["bulk_roots", "odd_chunks"]

#: Sublane rows of chunks per kernel invocation of a large batch: 32 x 128 = 4096 chunks
#: (4 MiB of message). 8 rows ran at 151 GB/s on the v5e, 16 and 32 at 215-217 GB/s.
ROWS = 32
LANES = 128
#: Sublane rows of chunks per invocation of the bulk kernel: 16 x 128 = 2048 chunks, 2
#: MiB of a leaf (each leaf is padded to whole invocations). On a v5e the bench state's
#: roots took 42.1 ms so; pairing the rows' halves, 48.0 ms at 16 rows and 53.6 at 32
#: (``docs/reliability.md`` section 10).
BULK_ROWS = 16


def _i32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _rotr(x: Any, n: int) -> Any:
    return lax.shift_right_logical(x, jnp.int32(n)) | lax.shift_left(x, jnp.int32(32 - n))


def _g(v: list[Any], a: int, b: int, c: int, d: int, x: Any, y: Any) -> None:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 12)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 8)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 7)


def _round(state: tuple[Any, ...]) -> tuple[Any, ...]:
    v, m = list(state[:16]), state[16:]
    _g(v, 0, 4, 8, 12, m[0], m[1])  # columns
    _g(v, 1, 5, 9, 13, m[2], m[3])
    _g(v, 2, 6, 10, 14, m[4], m[5])
    _g(v, 3, 7, 11, 15, m[6], m[7])
    _g(v, 0, 5, 10, 15, m[8], m[9])  # diagonals
    _g(v, 1, 6, 11, 12, m[10], m[11])
    _g(v, 2, 7, 8, 13, m[12], m[13])
    _g(v, 3, 4, 9, 14, m[14], m[15])
    return (*v, *(m[p] for p in _PERMUTATION))


def compress(
    cv: Sequence[Any],
    m: Sequence[Any],
    counter: Any,
    block_len: Any,
    flags: Any,
    *,
    unroll: bool = True,
) -> list[Any]:
    """BLAKE3's compression function (section 2.2) on sixteen separate int32 word
    arrays of one shape, first eight output words; ``counter`` and ``flags`` are arrays
    or scalars of that shape. ``unroll=False`` loops over the rounds (XLA:CPU, which
    runs the interpreted kernels, compiles seven unrolled rounds slowly)."""
    zero = jnp.zeros(cv[0].shape, jnp.int32)
    iv = (zero + _i32(w) for w in IV[:4])
    state = (*cv, *iv, zero + counter, zero, zero + block_len, zero + flags, *m)
    if unroll:
        for _ in range(7):
            state = _round(state)
    else:
        state = lax.fori_loop(0, 7, lambda _, s: _round(s), state)
    return [state[i] ^ state[i + 8] for i in range(8)]


def _message_kernel(
    key: tuple[int, ...],
    per: int,
    rows: int,
    levels: int,
    unroll: bool,
    x_ref: Any,
    p_ref: Any,
    o_ref: Any,
    s_ref: Any,
) -> None:
    """The subtrees of ``2**levels`` chunks over ``rows * 128`` full chunks of leaf data.

    ``x_ref`` is ``(256, rows, 128)`` data words (word, chunk); the chunk at ``(r, l)`` is
    chunk ``l * rows + r`` of the block, so that neighbouring chunks share a lane: a
    subtree's level pairs every other row (strided loads from VMEM) rather than shuffling
    lanes. (Pairing the two halves of the rows, with the rows bit-reversed by the
    transpose, was slower on a v5e: the transpose's longer shape costs more than the
    strided loads, ``docs/reliability.md`` section 10.) ``p_ref`` ``(1, rows, 128)``
    holds the data word before each chunk (zero where a message starts): message word
    ``k`` is ``(d[k-1] >> 24) | (d[k] << 8)``, the leaf prefix byte shifting the data by
    one byte, computed here rather than by a pass over the state in HBM.
    """
    shape = (rows, LANES)
    row = lax.broadcasted_iota(jnp.int32, shape, 0)
    offset = lax.broadcasted_iota(jnp.int32, shape, 1) * rows + row
    counter = (pl.program_id(0) * (rows * LANES) + offset) & (per - 1)

    def block(j: Any, state: tuple[Any, ...]) -> tuple[Any, ...]:
        flags = KEYED_HASH | jnp.where(j == 0, CHUNK_START, 0) | jnp.where(j == 15, CHUNK_END, 0)
        prev, m = state[8], []
        for w in range(16):
            data = x_ref[j * 16 + w]
            m.append(
                lax.shift_left(data, jnp.int32(8)) | lax.shift_right_logical(prev, jnp.int32(24))
            )
            prev = data
        out = compress(state[:8], m, counter, 64, flags.astype(jnp.int32), unroll=unroll)
        return (*out, prev)

    init = (*(jnp.full(shape, _i32(k), jnp.int32) for k in key), p_ref[0])
    cv = list(lax.fori_loop(jnp.int32(0), jnp.int32(CHUNK_WORDS // 16), block, init)[:8])
    n = rows
    for _ in range(levels):
        for i in range(8):
            s_ref[i, pl.ds(0, n)] = cv[i]
        n //= 2
        pair = (s_ref[:, pl.ds(0, n, stride=2)], s_ref[:, pl.ds(1, n, stride=2)])
        left, right = [pair[0][i] for i in range(8)], [pair[1][i] for i in range(8)]
        zero = jnp.zeros((n, LANES), jnp.int32)
        parent = [zero + _i32(k) for k in key]
        cv = compress(parent, left + right, 0, 64, KEYED_HASH | PARENT, unroll=unroll)
    for i in range(8):
        o_ref[0, i] = cv[i]


def _odd_kernel(key: tuple[int, ...], unroll: bool, x_ref: Any, t_ref: Any, o_ref: Any) -> None:
    """Chaining values of chunks of any length: ``x_ref`` as for :func:`_chunk_kernel`,
    ``t_ref`` ``(3, rows, 128)``: each chunk's counter, byte length (1 to 1024; 0 for
    padding) and ROOT flag. Blocks past a chunk's last leave its value as it is."""
    counter, length, root = t_ref[0], t_ref[1], t_ref[2]
    # Shifts, not floor division: Mosaic lowers `//` on integers through `sign`, which
    # asks the TPU generation of the machine that lowers it.
    blocks = jnp.maximum(
        1, lax.shift_right_logical(length + (BLOCK - 1), jnp.int32(BLOCK.bit_length() - 1))
    )

    def block(j: Any, cv: tuple[Any, ...]) -> tuple[Any, ...]:
        last = j == blocks - 1
        flags = KEYED_HASH | jnp.where(j == 0, CHUNK_START, 0)
        flags = flags | jnp.where(last, CHUNK_END, 0) | jnp.where(last & (root != 0), ROOT, 0)
        flags = flags.astype(jnp.int32)
        block_len = jnp.clip(length - BLOCK * j, 0, BLOCK).astype(jnp.int32)
        m = [x_ref[j * 16 + w] for w in range(16)]
        out = compress(cv, m, counter, block_len, flags, unroll=unroll)
        return tuple(jnp.where(j < blocks, new, old) for new, old in zip(out, cv, strict=True))

    init = tuple(jnp.full(counter.shape, _i32(k), jnp.int32) for k in key)
    cv = lax.fori_loop(jnp.int32(0), jnp.int32(CHUNK_WORDS // 16), block, init)
    for i in range(8):
        o_ref[i] = cv[i]


def _parent_kernel(
    key: tuple[int, ...], unroll: bool, left_ref: Any, right_ref: Any, o_ref: Any
) -> None:
    """BLAKE3 parent nodes (section 2.5), not roots: ``(8, rows, 128)`` children each."""
    cv = [jnp.full(left_ref.shape[1:], _i32(k), jnp.int32) for k in key]
    m = [left_ref[i] for i in range(8)] + [right_ref[i] for i in range(8)]
    out = compress(cv, m, 0, 64, KEYED_HASH | PARENT, unroll=unroll)
    for i in range(8):
        o_ref[i] = out[i]


def _tiles(x: Any, rows: int) -> Any:
    """``(k, n)`` -> ``(k, n' / 128, 128)``, zero-padded to whole kernel invocations."""
    n = x.shape[1]
    return jnp.pad(x, ((0, 0), (0, -n % (rows * LANES)))).reshape(x.shape[0], -1, LANES)


def _call(kernel: Any, inputs: Sequence[Any], rows: int, interpret: bool) -> Any:
    """Run ``kernel`` over ``(k, R, 128)`` inputs in steps of ``rows`` sublane rows."""
    total = inputs[0].shape[1]
    return pl.pallas_call(
        kernel,
        grid=(total // rows,),
        in_specs=[pl.BlockSpec((x.shape[0], rows, LANES), lambda i: (0, i, 0)) for x in inputs],
        out_specs=pl.BlockSpec((8, rows, LANES), lambda i: (0, i, 0)),
        out_shape=jax.ShapeDtypeStruct((8, total, LANES), jnp.int32),  # type: ignore[no-untyped-call]
        interpret=interpret,
    )(*inputs)


def _rows_for(n: int) -> int:
    return ROWS if n >= ROWS * LANES else 8


def _odd(matrix: Any, tables: Any, key: tuple[int, ...], interpret: bool) -> Any:
    count = matrix.shape[0]
    rows = _rows_for(count)
    words = _tiles(lax.bitcast_convert_type(matrix, jnp.int32).T, rows)
    kernel = functools.partial(_odd_kernel, key, not interpret)
    cv = _call(kernel, [words, _tiles(tables, rows)], rows, interpret).reshape(8, -1)[:, :count]
    return lax.bitcast_convert_type(cv, jnp.uint32)


def odd_chunks(
    matrix: Any, key: Sequence[int], counter: np.ndarray, length: np.ndarray, root: np.ndarray
) -> list[Any]:
    """The chaining value of each row of ``matrix`` (``zkdv.device_merkle`` step 3).

    Args:
        matrix: ``(n, 256)`` uint32: BLAKE3 chunks, zero past their length.
        key: the eight words of the BLAKE3 key.
        counter, length, root: per chunk, its counter in its message, its byte length
            (1 to 1024) and whether it is its message's only chunk (the ROOT flag).

    Returns:
        Eight ``(n,)`` uint32 arrays: word ``i`` of each chunk's chaining value (its
        first eight output words when it is a root).
    """
    key = tuple(int(k) for k in key)
    tables = jnp.asarray(np.stack([counter, length, root]).astype(np.int32))
    out = lax.platform_dependent(
        matrix,
        tables,
        tpu=functools.partial(_odd, key=key, interpret=False),
        default=functools.partial(_odd, key=key, interpret=True),
    )
    return [out[i] for i in range(8)]


def parents(left: Any, right: Any, key: tuple[int, ...], interpret: bool) -> Any:
    """One level of parent nodes: ``(8, n)`` int32 children each, ``(8, n)`` parents."""
    n = left.shape[1]
    rows = _rows_for(n)
    kernel = functools.partial(_parent_kernel, key, not interpret)
    tiles = [_tiles(left, rows), _tiles(right, rows)]
    return _call(kernel, tiles, rows, interpret).reshape(8, -1)[:, :n]


def _to_tiles(v: Any, rows: int) -> Any:
    """``(..., blocks * rows * 128)`` in chunk order -> ``(..., blocks * rows, 128)`` in
    :func:`_message_kernel`'s layout (with the transpose before it, one copy in XLA)."""
    lead = v.shape[:-1]
    v = v.reshape(*lead, -1, LANES, rows).swapaxes(-1, -2)
    return v.reshape(*lead, -1, LANES)


def _from_tiles(t: Any) -> Any:
    """The inverse of :func:`_to_tiles`, over ``(..., blocks, rows, 128)``."""
    return t.swapaxes(-1, -2).reshape(*t.shape[:-3], -1)


def _leaf_tiles(words: Any, n: int, padded: int, per: int, rows: int) -> tuple[Any, Any, Any]:
    """A leaf's first ``n`` chunks in the kernel's layout, zero-padded to ``padded``; the
    data word before each chunk (zero where a message starts), likewise; each chunk's
    last data word, in chunk order."""
    data = lax.bitcast_convert_type(words[: n * CHUNK_WORDS], jnp.int32).reshape(n, CHUNK_WORDS)
    tiles = _to_tiles(jnp.pad(data, ((0, padded - n), (0, 0))).T, rows)
    last = _from_tiles(tiles[CHUNK_WORDS - 1].reshape(-1, rows, LANES))
    prev = jnp.concatenate([jnp.zeros((1,), jnp.int32), last[:-1]])
    prev = jnp.where(jnp.arange(padded) % per == 0, 0, prev)
    return tiles, _to_tiles(prev, rows), last


def _bulk(
    *leaf_words: Any,
    counts: tuple[int, ...],
    key: tuple[int, ...],
    per: int,
    interpret: bool,
) -> tuple[Any, Any]:
    """``(8, sum(counts))`` int32: the perfect subtree of each full Merkle chunk (``per``
    BLAKE3 chunks) of each leaf, in one kernel call over every leaf's tiles; and each
    one's last data word (``(sum(counts),)``: its tail chunk's byte).

    Each leaf is padded to whole kernel invocations (and whole messages), so that a chunk's
    counter is its index in the batch modulo ``per``.
    """
    rows = BULK_ROWS
    size = rows * LANES
    unit = max(size, per)
    tiles, prevs, spans, lasts = [], [], [], []
    for words, count in zip(leaf_words, counts, strict=True):
        n = count * per
        padded = -(-n // unit) * unit
        leaf_tiles, prev, last = _leaf_tiles(words, n, padded, per, rows)
        lasts.append(last[per - 1 : n : per])
        tiles.append(leaf_tiles)
        prevs.append(prev)
        spans.append((n, padded))
    levels = min(per.bit_length(), rows.bit_length()) - 1
    out_rows = rows >> levels
    blocks = sum(padded for _, padded in spans) // size
    kernel = functools.partial(_message_kernel, key, per, rows, levels, not interpret)
    out = pl.pallas_call(
        kernel,
        grid=(blocks,),
        in_specs=[
            pl.BlockSpec((CHUNK_WORDS, rows, LANES), lambda i: (0, i, 0)),
            pl.BlockSpec((1, rows, LANES), lambda i: (0, i, 0)),
        ],
        out_specs=pl.BlockSpec((1, 8, out_rows, LANES), lambda i: (i, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((blocks, 8, out_rows, LANES), jnp.int32),  # type: ignore[no-untyped-call]
        scratch_shapes=[pltpu.VMEM((8, rows, LANES), jnp.int32)],
        interpret=interpret,
    )(jnp.concatenate(tiles, axis=1), jnp.concatenate(prevs)[None])
    cv = _from_tiles(out.swapaxes(0, 1))
    pieces, start = [], 0
    for n, padded in spans:
        pieces.append(cv[:, start >> levels : (start + n) >> levels])
        start += padded
    cv = jnp.concatenate(pieces, axis=1)
    width = per >> levels
    while width > 1:  # the levels above a lane's rows, a level at a time
        pairs = cv.reshape(8, -1, 2)
        cv = parents(pairs[:, :, 0], pairs[:, :, 1], key, interpret)
        width //= 2
    return cv, jnp.concatenate(lasts)


def bulk_roots(
    leaf_words: Sequence[Any], counts: Sequence[int], key: Sequence[int], per: int
) -> tuple[list[Any], Any]:
    """The root of each bulk message's perfect subtree (``zkdv.device_merkle`` steps 1-2)
    from the leaves' data words: one copy of them into the kernel's word-major layout (the
    transposes and their concatenation, which XLA fuses), and the leaf prefix's byte
    shift, the compression and the subtrees' first levels in the kernel.

    Args:
        leaf_words: each leaf with full Merkle chunks, as 1-D uint32 words.
        counts: each one's full Merkle chunks (its first ``count * per * 256`` words).
        key: the eight words of the BLAKE3 key.
        per: full BLAKE3 chunks in a Merkle chunk, a power of two.

    Returns:
        Eight ``(sum(counts),)`` uint32 arrays, leaf after leaf: word ``i`` of each
        subtree's chaining value (not a root node: the message's tail chunk is its
        root's right child); and each message's last data word, whose top byte is
        its tail chunk.
    """
    key = tuple(int(k) for k in key)
    bulk = functools.partial(_bulk, counts=tuple(counts), key=key, per=per)
    cv, last = lax.platform_dependent(
        *leaf_words,
        tpu=functools.partial(bulk, interpret=False),
        default=functools.partial(bulk, interpret=True),
    )
    cv = lax.bitcast_convert_type(cv, jnp.uint32)
    return [cv[i] for i in range(8)], lax.bitcast_convert_type(last, jnp.uint32)
