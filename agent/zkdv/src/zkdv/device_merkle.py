"""State commitments computed where the state lives: BLAKE3 and ``zkdv.merkle`` as array code.

The frontends' device paths (``zkdv.jax.device_merkle``, ``zkdv.torch._device_merkle``)
hash a state's chunks on the accelerator and hand the host one 32-byte chunk root per
leaf. The roots are bit-identical to :func:`zkdv.merkle.commit_state`'s, because the
algorithm here *is* that scheme, written once against a tiny array interface
(:class:`Ops`) that numpy, ``jax.numpy`` and Torch each implement:

* BLAKE3 (the BLAKE3 specification, sections 2.2-2.6): the compression function on
  uint32 words, keyed mode (every compression carries ``KEYED_HASH`` and starts from the
  key), 1024-byte chunks of 64-byte blocks, and the binary tree whose left subtree holds
  the largest power-of-two number of chunks. Hashes are 32 bytes, so the root node's
  first eight output words are the digest.
* ``zkdv.merkle``: a leaf's bytes (C order, little endian) cut into ``chunk_bytes``
  chunks; each chunk hashed as ``H_leaf(0x00 || chunk)`` under the ``leaf`` domain key;
  chunk hashes combined as ``H_node(0x01 || left || right)`` under the ``node`` key in
  RFC 6962's shape (pair neighbours, carry an odd last node up).

The leaf prefix byte shifts every chunk by one byte against the word grid, so a BLAKE3
message word is built from two data words (``(d[k-1] >> 24) | (d[k] << 8)``), and a
chunk of ``chunk_bytes`` is a BLAKE3 message of ``chunk_bytes + 1`` bytes: for chunks of
at least 1 KiB, ``S = chunk_bytes / 1024`` full BLAKE3 chunks and a one-byte tail chunk.

Everything that depends only on the shapes is decided once, on the host, by
:class:`HashPlan`; the array code then has no data-dependent control flow and no loop
over chunks:

1. *bulk*: every full BLAKE3 chunk of every full Merkle chunk of every leaf, stacked into
   one ``(N, 256)`` word matrix and compressed block by block in one batch (the bytes of
   the state, once);
2. their perfect subtrees (``S`` chunks per Merkle chunk) as ``log2(S)`` batched levels;
3. *odd* chunks (one-byte tails, a leaf's last partial Merkle chunk, every chunk when
   ``chunk_bytes < 1024``): a second, small batch with per-chunk lengths and flags;
4. each Merkle chunk's root node, then the RFC 6962 tree of every leaf: batched levels
   over static gather indices.

The tensor digest (path, dtype, shape) and the state root are a few hundred bytes per
leaf and stay on the host (:func:`state_commitment`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from zkdv.hashing import Domain, key_for
from zkdv.merkle import LeafSpec, StateCommitment, state_root, tensor_digest

__all__ = [
    "BLAKE3_CHUNK",
    "EagerOps",
    "HashPlan",
    "NumpyOps",
    "Ops",
    "chunk_roots",
    "compress",
    "roots_to_bytes",
    "state_commitment",
]

BLAKE3_CHUNK = 1024
BLOCK = 64
BLOCK_WORDS = 16
CHUNK_WORDS = BLAKE3_CHUNK // 4

# BLAKE3 specification, section 2.1: SHA-256's IV, the flags, the message permutation.
IV = (
    0x6A09E667,
    0xBB67AE85,
    0x3C6EF372,
    0xA54FF53A,
    0x510E527F,
    0x9B05688C,
    0x1F83D9AB,
    0x5BE0CD19,
)
CHUNK_START = 1 << 0
CHUNK_END = 1 << 1
PARENT = 1 << 2
ROOT = 1 << 3
KEYED_HASH = 1 << 4
_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)


def key_words(use: str) -> tuple[int, ...]:
    """The eight little-endian words of ``use``'s BLAKE3 key (:func:`zkdv.hashing.key_for`)."""
    return tuple(int(w) for w in np.frombuffer(key_for(use), dtype="<u4"))


class Ops(Protocol):
    """The array operations the algorithm needs; one implementation per framework.

    Arrays hold uint32 words (Torch: int32 with the same bits). ``+``, ``^``, ``|`` and
    ``&`` between arrays and :meth:`const` values must wrap modulo 2**32. Index
    arguments given as numpy arrays are static (known when the program is built).
    """

    def const(self, value: int) -> Any: ...
    def full(self, count: int, value: int) -> Any: ...
    def array(self, values: np.ndarray) -> Any: ...
    def shr(self, x: Any, n: int) -> Any: ...
    def shl(self, x: Any, n: int) -> Any: ...
    def rotr(self, x: Any, n: int) -> Any: ...
    def batch_shape(self, items: Sequence[Any]) -> tuple[int, ...]: ...
    def stack(self, items: Sequence[Any], shape: tuple[int, ...]) -> Any: ...
    def unstack(self, x: Any) -> list[Any]: ...
    def rows(self, x: Any, index: Sequence[int]) -> Any: ...
    def roll(self, x: Any, shift: int) -> Any: ...
    def concat(self, parts: Sequence[Any], axis: int = 0) -> Any: ...
    def take(self, x: Any, index: np.ndarray) -> Any: ...
    def select(self, mask: Any, a: Any, b: Any) -> Any: ...
    def zeros(self, shape: tuple[int, ...]) -> Any: ...
    def pad_to(self, x: Any, width: int) -> Any: ...
    def column(self, x: Any, index: Any) -> Any: ...
    def row(self, table: Any, index: Any) -> Any: ...
    def flag(self, condition: Any, value: int) -> Any: ...

    #: Hash the levels of the bulk subtrees at their exact sizes (one program per
    #: level) rather than as one fixed-shape loop (less work, a larger program).
    exact_levels: bool

    def fori(
        self, count: int, body: Callable[[Any, list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]: ...
    def rounds(
        self, count: int, body: Callable[[list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]: ...
    def loop(
        self, count: int, body: Callable[[Any, list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]: ...
    def bulk_roots(self, plan: HashPlan, words: Sequence[Any], key: Sequence[int]) -> Any:
        """Steps 1-2 by a backend's kernels from the leaves' words as they lie, or None
        for the array code: :func:`_bulk_roots`'s result and each message's last data word."""
        ...

    def odd_chunks(self, matrix: Any, key: Sequence[int], plan: HashPlan) -> list[Any] | None:
        """Step 3's chaining values by a backend's own kernels (each row of ``matrix`` a
        BLAKE3 chunk with ``plan``'s odd counter, length and ROOT flag), or None."""
        ...


def compress(
    ops: Ops, cv: Sequence[Any], m: Sequence[Any], counter: Any, block_len: Any, flags: Any
) -> list[Any]:
    """BLAKE3's compression function (section 2.2), first eight output words.

    The state is held as four rows of four words (``a``, ``b``, ``c``, ``d``: the
    columns of the 4x4 matrix), so one G call updates all four columns at once and the
    diagonal step is the same call on rotated rows; the rounds run through
    :meth:`Ops.rounds` (a loop where the backend prefers a small program).
    """
    shape = ops.batch_shape([*cv, *m, counter, block_len, flags])
    a = ops.stack(list(cv[:4]), shape)
    b = ops.stack(list(cv[4:]), shape)
    c = ops.stack([ops.const(w) for w in IV[:4]], shape)
    d = ops.stack([counter, ops.const(0), block_len, flags], shape)
    message = ops.stack(list(m), shape)
    rotr = ops.rotr

    def g(a: Any, b: Any, c: Any, d: Any, x: Any, y: Any) -> tuple[Any, Any, Any, Any]:
        a = a + b + x
        d = rotr(d ^ a, 16)
        c = c + d
        b = rotr(b ^ c, 12)
        a = a + b + y
        d = rotr(d ^ a, 8)
        c = c + d
        b = rotr(b ^ c, 7)
        return a, b, c, d

    def one_round(state: list[Any]) -> list[Any]:
        a, b, c, d, m = state
        # Columns: G(v0, v4, v8, v12, m0, m1), ..., G(v3, v7, v11, v15, m6, m7).
        a, b, c, d = g(a, b, c, d, ops.rows(m, _EVEN_COLUMNS), ops.rows(m, _ODD_COLUMNS))
        # Diagonals: row i of b, c, d rotated left by 1, 2, 3 lines up v0 v5 v10 v15 etc.
        b, c, d = ops.roll(b, 1), ops.roll(c, 2), ops.roll(d, 3)
        a, b, c, d = g(a, b, c, d, ops.rows(m, _EVEN_DIAGONALS), ops.rows(m, _ODD_DIAGONALS))
        b, c, d = ops.roll(b, 3), ops.roll(c, 2), ops.roll(d, 1)
        return [a, b, c, d, ops.rows(m, _PERMUTATION)]

    a, b, c, d, _ = ops.rounds(7, one_round, [a, b, c, d, message])
    low = a ^ c
    high = b ^ d
    return [*ops.unstack(low), *ops.unstack(high)]


_EVEN_COLUMNS = (0, 2, 4, 6)
_ODD_COLUMNS = (1, 3, 5, 7)
_EVEN_DIAGONALS = (8, 10, 12, 14)
_ODD_DIAGONALS = (9, 11, 13, 15)


def _parent(
    ops: Ops, key: Sequence[Any], left: Sequence[Any], right: Sequence[Any], flags: Any
) -> list[Any]:
    """A BLAKE3 parent node (section 2.5): the block is the two children's chaining values."""
    return compress(ops, key, [*left, *right], ops.const(0), ops.const(BLOCK), flags)


def _merkle_node(
    ops: Ops, key: Sequence[Any], left: Sequence[Any], right: Sequence[Any]
) -> list[Any]:
    """``H_node(0x01 || left || right)``: one 65-byte BLAKE3 chunk, two blocks, a root."""
    stream = [*left, *right]
    words = [ops.const(0x01) | ops.shl(stream[0], 8)]
    words += [ops.shr(stream[i - 1], 24) | ops.shl(stream[i], 8) for i in range(1, 16)]
    cv = compress(
        ops, key, words, ops.const(0), ops.const(BLOCK), ops.const(CHUNK_START | KEYED_HASH)
    )
    zero = ops.const(0)
    last = [ops.shr(stream[15], 24)] + [zero] * 15
    return compress(ops, cv, last, zero, ops.const(1), ops.const(CHUNK_END | ROOT | KEYED_HASH))


# --- the static plan --------------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    """One batched level of a segmented tree reduction: pairs hashed, odd nodes carried.

    The next level is ``take(concat(hashed_pairs, current), order)``.
    """

    left: np.ndarray
    right: np.ndarray
    roots: np.ndarray  # per pair: this pair is its segment's root (BLAKE3 ROOT flag)
    order: np.ndarray


def _reduce_plan(segments: Sequence[Sequence[int]]) -> tuple[list[_Level], list[int]]:
    """Levels that reduce each segment of positions to one node, RFC 6962 / BLAKE3 shape."""
    levels: list[_Level] = []
    segs = [list(s) for s in segments]
    while any(len(s) > 1 for s in segs):
        left: list[int] = []
        right: list[int] = []
        roots: list[bool] = []
        pending: list[list[tuple[bool, int]]] = []
        for s in segs:
            out: list[tuple[bool, int]] = []
            for i in range(0, len(s) - 1, 2):
                out.append((True, len(left)))
                left.append(s[i])
                right.append(s[i + 1])
                roots.append(len(s) == 2)
            if len(s) % 2:
                out.append((False, s[-1]))
            pending.append(out)
        pairs = len(left)
        order: list[int] = []
        segs = []
        for out in pending:
            seg = []
            for hashed, position in out:
                seg.append(len(order))
                order.append(position if hashed else pairs + position)
            segs.append(seg)
        levels.append(
            _Level(
                np.asarray(left, np.int32),
                np.asarray(right, np.int32),
                np.asarray(roots, bool),
                np.asarray(order, np.int32),
            )
        )
    return levels, [s[0] for s in segs]


@dataclass(frozen=True)
class _Reduction:
    """A segmented tree reduction as fixed-shape tables, one row per level.

    ``x`` (``width`` nodes, zero-padded) becomes, per level ``l``,
    ``take(concat(hash(x[left[l]], x[right[l]]), x), order[l])``; after the last level
    the segments' roots are at ``finals``. Padding entries point at node 0 and are never
    read back, so every level has the same shape and the levels can run as a loop.
    ``steps`` are the same levels at their exact sizes (the pairs each hashes and the
    nodes it keeps), for a schedule that hashes each level as its own program.
    """

    width: int
    left: np.ndarray
    right: np.ndarray
    roots: np.ndarray
    order: np.ndarray
    finals: np.ndarray
    steps: tuple[_Level, ...] = ()

    @property
    def levels(self) -> int:
        return int(self.left.shape[0])

    @classmethod
    def build(cls, segments: Sequence[Sequence[int]], start: int) -> _Reduction:
        levels, finals = _reduce_plan(segments)
        pairs = max((len(level.left) for level in levels), default=0)
        width = max([start, *(len(level.order) for level in levels)])
        shape = (len(levels), max(1, pairs))
        left = np.zeros(shape, np.int32)
        right = np.zeros(shape, np.int32)
        roots = np.zeros(shape, bool)
        order = np.zeros((len(levels), width), np.int32)
        for i, level in enumerate(levels):
            n = len(level.left)
            left[i, :n], right[i, :n], roots[i, :n] = level.left, level.right, level.roots
            shifted = np.where(level.order < n, level.order, level.order - n + shape[1])
            order[i, : len(level.order)] = shifted
        return cls(width, left, right, roots, order, np.asarray(finals, np.int32), tuple(levels))


@dataclass(frozen=True)
class LeafPlan:
    nbytes: int
    words: int  # data words, ceil(nbytes / 4)
    chunks: int  # Merkle chunks, at least 1
    full: int  # Merkle chunks of exactly chunk_bytes
    partial: int  # bytes of the last, short Merkle chunk; -1 when there is none


@dataclass(frozen=True)
class HashPlan:
    """Everything about hashing a state that depends only on leaf sizes and ``chunk_bytes``.

    Built once per state layout on the host; the array code reads only its static
    integers and small index arrays.
    """

    chunk_bytes: int
    leaves: tuple[LeafPlan, ...]
    # Odd BLAKE3 chunks, in construction order: counter, byte length, ROOT flag.
    odd_counter: np.ndarray = field(repr=False)
    odd_length: np.ndarray = field(repr=False)
    odd_root: np.ndarray = field(repr=False)
    odd_blocks: int = 0
    # Bulk messages' tails in the odd batch (chunk_bytes >= 1024), in bulk order.
    tail_index: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int32))
    odd_tree: _Reduction | None = field(repr=False, default=None)
    # Merkle-chunk hashes in leaf order from concat(bulk message roots, odd message roots).
    chunk_order: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int32))
    merkle_tree: _Reduction | None = field(repr=False, default=None)

    @property
    def per_message(self) -> int:
        """Full BLAKE3 chunks in one full Merkle chunk (0 below 1 KiB chunks)."""
        return self.chunk_bytes // BLAKE3_CHUNK

    @property
    def bulk_messages(self) -> int:
        return sum(leaf.full for leaf in self.leaves) if self.per_message else 0

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @classmethod
    def build(cls, nbytes: Sequence[int], chunk_bytes: int) -> HashPlan:
        """Plan the hashing of leaves of ``nbytes`` each (in state order).

        Raises:
            ValueError: ``chunk_bytes`` is not a power of two of at least 64 bytes.
        """
        if chunk_bytes < 64 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a power of two >= 64")
        per = chunk_bytes // BLAKE3_CHUNK
        leaves = []
        for size in nbytes:
            size = int(size)
            full = size // chunk_bytes
            rest = size - full * chunk_bytes
            partial = rest if rest or size == 0 else -1
            leaves.append(LeafPlan(size, -(-size // 4), full + (partial >= 0), full, partial))
        counter: list[int] = []
        length: list[int] = []
        root: list[bool] = []
        tails: list[int] = []
        # Messages made of odd chunks: (leaf, Merkle chunk) -> positions in the odd batch.
        # The batch holds, in this order, what each full Merkle chunk leaves over (its
        # one-byte tail, or the whole message below 1 KiB chunks), leaf after leaf, then
        # every leaf's last partial Merkle chunk: two runs that :func:`_chunk_rows` builds
        # with one concatenation each, whatever the number of leaves.
        odd_messages: list[list[int]] = []
        odd_owner: list[tuple[int, int]] = []
        for index, leaf in enumerate(leaves):
            for chunk in range(leaf.full):
                if per:
                    tails.append(len(counter))
                else:
                    odd_owner.append((index, chunk))
                    odd_messages.append([len(counter)])
                counter.append(per)
                length.append(1 if per else chunk_bytes + 1)
                root.append(not per)
        for index, leaf in enumerate(leaves):
            if leaf.partial >= 0:
                message = leaf.partial + 1
                count = -(-message // BLAKE3_CHUNK)
                positions = []
                for b in range(count):
                    positions.append(len(counter))
                    counter.append(b)
                    length.append(min(BLAKE3_CHUNK, message - b * BLAKE3_CHUNK))
                    root.append(count == 1)
                odd_owner.append((index, leaf.full))
                odd_messages.append(positions)
        odd_tree = _Reduction.build(odd_messages, len(counter))
        # Merkle-chunk hashes: bulk message roots first (leaf-major), then odd ones.
        bulk_position: dict[tuple[int, int], int] = {}
        if per:
            for index, leaf in enumerate(leaves):
                for chunk in range(leaf.full):
                    bulk_position[(index, chunk)] = len(bulk_position)
        odd_position = {owner: len(bulk_position) + i for i, owner in enumerate(odd_owner)}
        order: list[int] = []
        segments: list[list[int]] = []
        for index, leaf in enumerate(leaves):
            segment = []
            for chunk in range(leaf.chunks):
                key = (index, chunk)
                segment.append(len(order))
                order.append(bulk_position[key] if key in bulk_position else odd_position[key])
            segments.append(segment)
        merkle_tree = _Reduction.build(segments, len(order))
        blocks = max((-(-n // BLOCK) for n in length), default=0)
        return cls(
            chunk_bytes=chunk_bytes,
            leaves=tuple(leaves),
            odd_counter=np.asarray(counter, np.uint32),
            odd_length=np.asarray(length, np.int64),
            odd_root=np.asarray(root, bool),
            odd_blocks=max(1, blocks) if length else 0,
            tail_index=np.asarray(tails, np.int32),
            odd_tree=odd_tree,
            chunk_order=np.asarray(order, np.int32),
            merkle_tree=merkle_tree,
        )

    def odd_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block and odd chunk: (block length, flags, active), each ``(blocks, n)``."""
        length = self.odd_length
        blocks = np.maximum(1, -(-length // BLOCK))
        j = np.arange(self.odd_blocks)[:, None]
        block_len = np.clip(length[None, :] - BLOCK * j, 0, BLOCK).astype(np.uint32)
        last = j == blocks[None, :] - 1
        flags = (
            KEYED_HASH
            + CHUNK_START * (j == 0)
            + CHUNK_END * last
            + ROOT * (last & self.odd_root[None, :])
        ).astype(np.uint32)
        active = j < blocks[None, :]
        return block_len, flags, active


# --- the algorithm ----------------------------------------------------------------------


def _message(ops: Ops, data: Any, chunks: int, *, chunk_bytes: int) -> tuple[Any, Any]:
    """Merkle chunks as prefixed BLAKE3 messages: ``(chunks, W)`` words + tails.

    ``data`` is ``(chunks, W)`` data words, ``W = chunk_bytes / 4``. Message word ``k``
    of a chunk is bytes ``4k-1 .. 4k+2`` of the chunk (byte ``-1`` is the 0x00 leaf
    prefix); word ``W`` holds the chunk's last byte alone.
    """
    width = chunk_bytes // 4
    head = ops.shl(data, 8)
    carried = ops.shr(data[:, : width - 1], 24)
    body = head | ops.concat([ops.zeros((chunks, 1)), carried], axis=1)
    return body, ops.shr(data[:, width - 1], 24)


def _chunk_batch(
    ops: Ops,
    matrix: Any,
    key: Sequence[Any],
    blocks: int,
    params: Callable[[Any], tuple[Any, Any, Any, Any]],
    count: int,
) -> list[Any]:
    """Compress a batch of BLAKE3 chunks, one row of 256 words each, block by block."""

    def body(j: Any, cv: list[Any]) -> list[Any]:
        counter, block_len, flags, active = params(j)
        m = [ops.column(matrix, j * BLOCK_WORDS + w) for w in range(BLOCK_WORDS)]
        out = compress(ops, cv, m, counter, block_len, flags)
        if active is None:
            return out
        return [ops.select(active, new, old) for new, old in zip(out, cv, strict=True)]

    init = [ops.full(count, k) for k in key]
    return ops.fori(blocks, body, init)


def _take(ops: Ops, x: Sequence[Any], index: np.ndarray) -> list[Any]:
    return [ops.take(w, index) for w in x]


def _cat(ops: Ops, a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    return [ops.concat([u, v]) for u, v in zip(a, b, strict=True)]


def chunk_roots(ops: Ops, plan: HashPlan, leaf_words: Sequence[Any]) -> list[Any]:
    """The chunk-tree root of every leaf, as eight word arrays of ``len(leaves)``.

    Args:
        ops: the framework's array operations.
        plan: :meth:`HashPlan.build` for these leaves' sizes.
        leaf_words: each leaf's bytes as 1-D little-endian words, ``ceil(nbytes / 4)``
            long, the last word zero-padded.
    """
    if not plan.leaves:
        return [ops.zeros((0,)) for _ in range(8)]
    leaf_key = [ops.const(w) for w in key_words(Domain.LEAF)]
    node_key = [ops.const(w) for w in key_words(Domain.NODE)]
    hashes: list[Any] = []
    nbulk = plan.bulk_messages
    kernel = ops.bulk_roots(plan, leaf_words, key_words(Domain.LEAF)) if nbulk else None
    bulk_roots, last = kernel if kernel is not None else (None, None)
    bulk, matrix = _chunk_rows(ops, plan, leaf_words, last=last)
    if nbulk and bulk_roots is None:
        bulk_roots = _bulk_roots(ops, plan, bulk, leaf_key)
    odd_count = len(plan.odd_counter)
    odd_cv = ops.odd_chunks(matrix, key_words(Domain.LEAF), plan)
    if odd_cv is None:
        block_len, flags, active = plan.odd_tables()
        counter = ops.array(plan.odd_counter)
        tables = (ops.array(block_len), ops.array(flags), ops.array(active))

        def odd_params(j: Any) -> tuple[Any, Any, Any, Any]:
            return counter, ops.row(tables[0], j), ops.row(tables[1], j), ops.row(tables[2], j)

        odd_cv = _chunk_batch(ops, matrix, leaf_key, plan.odd_blocks, odd_params, odd_count)
    if bulk_roots is not None:
        tails = _take(ops, odd_cv, plan.tail_index)
        hashes = _parent(ops, leaf_key, bulk_roots, tails, ops.const(PARENT | KEYED_HASH | ROOT))
    odd_tree = plan.odd_tree
    if odd_tree is not None and len(odd_tree.finals):

        def odd_pairs(left: list[Any], right: list[Any], roots: Any) -> list[Any]:
            flags = ops.const(PARENT | KEYED_HASH) | (roots * ops.const(ROOT))
            return _parent(ops, leaf_key, left, right, flags)

        odd_hashes = _reduce(ops, odd_tree, odd_cv, odd_pairs)
        hashes = _cat(ops, hashes, odd_hashes) if hashes else odd_hashes
    x = _take(ops, hashes, plan.chunk_order)
    assert plan.merkle_tree is not None

    def nodes(left: list[Any], right: list[Any], roots: Any) -> list[Any]:
        return _merkle_node(ops, node_key, left, right)

    return _reduce(ops, plan.merkle_tree, x, nodes)


def _chunk_rows(
    ops: Ops, plan: HashPlan, leaf_words: Sequence[Any], *, last: Any = None
) -> tuple[Any, Any]:
    """Every chunk of the state as rows of 256 message words: the bulk matrix (each full
    Merkle chunk's full BLAKE3 chunks, ``per_message`` rows a message; None when there
    are none, or when ``last``, the bulk messages' last data words, says that
    :meth:`Ops.bulk_roots` hashed them) and the odd matrix, in :meth:`HashPlan.build`'s order.

    The leaves' full and partial Merkle chunks are concatenated and each run shifted into
    messages at once: a few operations per leaf (of about 600 in a 135M model's state).
    """
    per = plan.per_message
    width = plan.chunk_bytes // 4
    pairs = list(zip(plan.leaves, leaf_words, strict=True))
    matrix = None
    odd: list[Any] = []
    fulls = [words[: leaf.full * width] for leaf, words in pairs if leaf.full]
    if last is not None:  # only each message's one-byte tail chunk: its last byte
        odd.append(ops.pad_to(ops.shr(last, 24).reshape(-1, 1), CHUNK_WORDS))
    elif fulls:
        data = (ops.concat(fulls) if len(fulls) > 1 else fulls[0]).reshape(-1, width)
        body, tail = _message(ops, data, data.shape[0], chunk_bytes=plan.chunk_bytes)
        if per:
            matrix = body.reshape(-1, CHUNK_WORDS)
            odd.append(ops.pad_to(tail.reshape(-1, 1), CHUNK_WORDS))
        else:
            whole = ops.concat([body, tail.reshape(-1, 1)], axis=1)
            odd.append(ops.pad_to(whole, CHUNK_WORDS))
    partials = []
    for leaf, words in pairs:
        if leaf.partial >= 0:
            count = -(-(leaf.partial + 1) // BLAKE3_CHUNK)
            partials.append(ops.pad_to(words[leaf.full * width :], count * CHUNK_WORDS))
    if partials:
        # One message per leaf, each padded to whole BLAKE3 chunks. The last word of
        # each has a zero top byte (its message ends before it), so shifting the whole
        # run at once carries a zero, the prefix byte, into the next message.
        data = ops.concat(partials) if len(partials) > 1 else partials[0]
        carried = ops.shr(ops.concat([ops.zeros((1,)), data[:-1]]), 24)
        odd.append((ops.shl(data, 8) | carried).reshape(-1, CHUNK_WORDS))
    return matrix, ops.concat(odd) if len(odd) > 1 else odd[0]


def _bulk_roots(ops: Ops, plan: HashPlan, matrix: Any, leaf_key: list[Any]) -> list[Any]:
    """The root of the perfect subtree of each bulk message's ``per_message`` full chunks."""
    per = plan.per_message
    nbulk = plan.bulk_messages
    count = nbulk * per
    counter = ops.array((np.arange(count) % per).astype(np.uint32))

    def bulk_params(j: Any) -> tuple[Any, Any, Any, Any]:
        flags = ops.const(KEYED_HASH) | ops.flag(j == 0, CHUNK_START)
        flags = flags | ops.flag(j == BLOCK_WORDS - 1, CHUNK_END)
        return counter, ops.const(BLOCK), flags, None

    cv = _chunk_batch(ops, matrix, leaf_key, BLOCK_WORDS, bulk_params, count)
    # The perfect subtree of each message's ``per`` full chunks (no ROOT: the tail
    # chunk is the root's right child).
    cv = [w.reshape(nbulk, per) for w in cv]
    parent_flags = ops.const(PARENT | KEYED_HASH)
    if ops.exact_levels:
        width = per
        while width > 1:
            cv = _parent(
                ops, leaf_key, [w[:, 0::2] for w in cv], [w[:, 1::2] for w in cv], parent_flags
            )
            width //= 2
    elif per > 1:
        # One program for every level: each pass writes the parents of adjacent pairs
        # into the first half of a fixed (nbulk, per) buffer; the rest is scratch.
        half = per // 2

        def level(_: Any, cv: list[Any]) -> list[Any]:
            left = [w[:, 0::2] for w in cv]
            right = [w[:, 1::2] for w in cv]
            parents = _parent(ops, leaf_key, left, right, parent_flags)
            return [ops.concat([p, w[:, half:]], axis=1) for p, w in zip(parents, cv, strict=True)]

        cv = ops.fori(per.bit_length() - 1, level, cv)
        cv = [w[:, :1] for w in cv]
    return [w.reshape(nbulk) for w in cv]


def _reduce(
    ops: Ops,
    tree: _Reduction,
    x: list[Any],
    hash_pairs: Callable[[list[Any], list[Any], Any], list[Any]],
) -> list[Any]:
    if tree.levels == 0:
        return _take(ops, x, tree.finals)
    if ops.exact_levels:  # each level at its size; the loop below hashes the widest's
        for step in tree.steps:
            roots = ops.array(step.roots.astype(np.uint32))
            pairs = hash_pairs(_take(ops, x, step.left), _take(ops, x, step.right), roots)
            x = _take(ops, _cat(ops, pairs, x), step.order)
        return _take(ops, x, tree.finals)
    x = [ops.pad_to(w, tree.width) for w in x]
    tables = [
        ops.array(t) for t in (tree.left, tree.right, tree.roots.astype(np.uint32), tree.order)
    ]

    def level(i: Any, x: list[Any]) -> list[Any]:
        left, right, roots, order = (ops.row(t, i) for t in tables)
        pairs = hash_pairs(_take(ops, x, left), _take(ops, x, right), roots)
        return _take(ops, _cat(ops, pairs, x), order)

    # A real loop on every schedule: the tables have one shape, and these levels (a few
    # per Merkle chunk of the state) are too little work to be worth a larger program.
    x = ops.loop(tree.levels, level, x)
    return _take(ops, x, tree.finals)


def roots_to_bytes(roots: np.ndarray) -> list[bytes]:
    """``(leaves, 8)`` uint32 chunk roots (from the device) as 32-byte digests."""
    words = np.ascontiguousarray(np.asarray(roots, dtype=np.uint32)).astype("<u4")
    return [words[i].tobytes() for i in range(words.shape[0])]


def state_commitment(specs: Sequence[LeafSpec], roots: Sequence[bytes]) -> StateCommitment:
    """The :class:`StateCommitment` of a state whose chunk roots were hashed elsewhere."""
    digests = tuple(tensor_digest(spec, root) for spec, root in zip(specs, roots, strict=True))
    return StateCommitment(state_root(specs, digests), tuple(specs), digests, tuple(roots))


# --- numpy: the reference implementation of the interface --------------------------------


class EagerOps:
    """The part of :class:`Ops` that every eager backend (numpy, Torch) writes alike.

    Indexing with Python or host indices, every level hashed at its exact size, and loops
    run in Python: each iteration issues its own operations (``torch.compile`` traces
    them into one unrolled graph). JAX, which compiles a loop as a loop, has its own
    (:class:`zkdv.jax.device_merkle.JaxOps`). A subclass supplies the arithmetic.
    """

    exact_levels = True

    def rows(self, x: Any, index: Sequence[int]) -> Any:
        return x[list(index)]

    def column(self, x: Any, index: Any) -> Any:
        return x[:, index]

    def row(self, table: Any, index: Any) -> Any:
        return table[index]

    def fori(
        self, count: int, body: Callable[[Any, list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]:
        state = init
        for j in range(count):
            state = body(j, state)
        return state

    def rounds(
        self, count: int, body: Callable[[list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]:
        state = init
        for _ in range(count):
            state = body(state)
        return state

    loop = fori

    def bulk_roots(self, plan: HashPlan, words: Sequence[Any], key: Sequence[int]) -> Any:
        return None

    def odd_chunks(self, matrix: Any, key: Sequence[int], plan: HashPlan) -> list[Any] | None:
        return None


class NumpyOps(EagerOps):
    """:class:`Ops` over numpy uint32 arrays: the reference the device kernels are tested
    against, and a readable statement of the algorithm."""

    def const(self, value: int) -> Any:
        return np.uint32(value)

    def full(self, count: int, value: int) -> Any:
        return np.full(count, value, np.uint32)

    def array(self, values: np.ndarray) -> Any:
        return values

    def shr(self, x: Any, n: int) -> Any:
        return x >> np.uint32(n)

    def shl(self, x: Any, n: int) -> Any:
        return x << np.uint32(n)

    def rotr(self, x: Any, n: int) -> Any:
        return (x >> np.uint32(n)) | (x << np.uint32(32 - n))

    def batch_shape(self, items: Sequence[Any]) -> tuple[int, ...]:
        return tuple(np.broadcast_shapes(*(np.shape(x) for x in items)))

    def stack(self, items: Sequence[Any], shape: tuple[int, ...]) -> Any:
        return np.stack([np.broadcast_to(x, shape) for x in items]).astype(np.uint32)

    def unstack(self, x: Any) -> list[Any]:
        return list(x)

    def roll(self, x: Any, shift: int) -> Any:
        return np.roll(x, -shift, axis=0)

    def concat(self, parts: Sequence[Any], axis: int = 0) -> Any:
        return np.concatenate(parts, axis=axis)

    def take(self, x: Any, index: np.ndarray) -> Any:
        return x[np.asarray(index)]

    def select(self, mask: Any, a: Any, b: Any) -> Any:
        return np.where(mask, a, b)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return np.zeros(shape, np.uint32)

    def pad_to(self, x: Any, width: int) -> Any:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]
        return np.pad(x, pad)

    def flag(self, condition: Any, value: int) -> Any:
        return np.uint32(value if condition else 0)


def numpy_words(array: np.ndarray) -> np.ndarray:
    """A host array's bytes (C order, little endian) as zero-padded uint32 words."""
    data = np.ascontiguousarray(array)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    raw = data.reshape(-1).view(np.uint8)
    padded = np.zeros(-(-raw.size // 4) * 4, np.uint8)
    padded[: raw.size] = raw
    return padded.view("<u4").astype(np.uint32)


def numpy_chunk_roots(arrays: Sequence[np.ndarray], chunk_bytes: int) -> list[bytes]:
    """Chunk roots through the array algorithm on numpy (tests; not a fast path)."""
    plan = HashPlan.build([a.nbytes for a in arrays], chunk_bytes)
    with np.errstate(over="ignore"):
        roots = chunk_roots(NumpyOps(), plan, [numpy_words(a) for a in arrays])
    return roots_to_bytes(np.stack(roots, axis=1).reshape(-1, 8))
