"""RFC 6962-style Merkle trees over chunked tensors, with coordinate openings.

A state (parameters, optimizer state or buffers) is an ordered list of tensor leaves.
Each leaf's raw bytes (C order, little endian) are cut into ``chunk_bytes`` chunks;
chunk hashes form the leaf's chunk tree, and a tensor digest binds the chunk tree's root
to the leaf's path, dtype and shape. The tensor digests form the state tree whose root
is the state root. Proving one coordinate discloses one chunk and two logarithmic paths.

Tree shape follows RFC 6962 section 2.1: a tree of n > 1 leaves splits at the largest
power of two smaller than n. Leaf hashes are ``H_leaf(0x00 || data)``, node hashes
``H_node(0x01 || left || right)``; the empty tree hashes to ``H_leaf(b"")``.

Hashing is the hot path of every training step, so chunks are hashed by a small pool of
threads; BLAKE3 releases the GIL while it hashes, and chunks of 1 MiB keep the Python
overhead per byte negligible (measured in ``bench/commit_throughput.py``).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from threading import Lock, local
from typing import Any

import blake3
import cbor2
import numpy as np

from zkdv.hashing import DIGEST_BYTES, Domain, hash_bytes, hasher
from zkdv.workers import demote, waiting

__all__ = [
    "ChunkOpening",
    "CoordinateOpening",
    "LeafSpec",
    "PendingCommitment",
    "StateCommitment",
    "commit_state",
    "inclusion_path",
    "merkle_root",
    "open_coordinate",
    "start_commit",
    "verify_inclusion",
    "verify_opening",
]

_LEAF_PREFIX = b"\x00"
_NODE_PREFIX = b"\x01"


# Hashers with their key and RFC 6962 prefix already absorbed: a commit hashes some ten
# small things per leaf every step, and cloning a primed hasher is cheaper than feeding
# it the prefix again each time.
_LEAF_PRIMED = hasher(Domain.LEAF)
_LEAF_PRIMED.update(_LEAF_PREFIX)
_LEAF_KEYED = hasher(Domain.LEAF)
_NODE_PRIMED = hasher(Domain.NODE)
_NODE_PRIMED.update(_NODE_PREFIX)

# BLAKE3 hashes its input in 1 KiB chunks, many at once across SIMD lanes, but an
# incremental update only hashes runs of chunks aligned to the chunk counter. Behind the
# one-byte leaf prefix, a leaf's data starts at counter 1, so a hasher fed the prefix
# and then the data works 1, 2, 4 and 8 chunks wide before it fills its lanes: 3-7
# microseconds more per leaf, 2.5x the time of a 4 KiB leaf and 1.3x of a 256 KiB one
# (measured on AVX-512). So the prefix and the data's first 16 KiB - 1 bytes are fed as
# one copied block, after which the rest starts at counter 16, aligned for the widest
# pass. The digest is the same: BLAKE3 is a function of the stream, not of how the
# updates cut it.
_HEAD_BYTES = 16 << 10
# Below this the copy costs more than the ramp it saves.
_HEAD_MIN_BYTES = 2 << 10
_heads = local()


def _head() -> memoryview:
    """This thread's block for a leaf's prefix and first bytes (hashing runs on a pool)."""
    head: memoryview | None = getattr(_heads, "block", None)
    if head is None:
        block = bytearray(_HEAD_BYTES)
        block[: len(_LEAF_PREFIX)] = _LEAF_PREFIX
        head = _heads.block = memoryview(block)
    return head


def _node(left: bytes, right: bytes) -> bytes:
    h = _NODE_PRIMED.copy()
    h.update(left + right)
    return h.digest()


def leaf_hash(data: bytes | memoryview) -> bytes:
    """``H_leaf(0x00 || data)``."""
    if len(data) < _HEAD_MIN_BYTES:
        h = _LEAF_PRIMED.copy()
        h.update(data)
        return h.digest()
    view = memoryview(data).cast("B")
    start = len(_LEAF_PREFIX)
    taken = min(len(view), _HEAD_BYTES - start)
    head = _head()
    head[start : start + taken] = view[:taken]
    h = _LEAF_KEYED.copy()
    h.update(head[: start + taken])
    if taken < len(view):
        h.update(view[taken:])
    return h.digest()


def _split(n: int) -> int:
    """Largest power of two strictly smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def merkle_root(hashes: Sequence[bytes]) -> bytes:
    """RFC 6962 Merkle tree hash over already-hashed leaves."""
    n = len(hashes)
    if n == 0:
        return leaf_hash(b"")
    if n == 1:
        return hashes[0]
    # Iterative bottom-up build that yields exactly RFC 6962's shape: pair adjacent
    # nodes and carry an odd last node up unchanged.
    level = list(hashes)
    while len(level) > 1:
        paired = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def inclusion_path(hashes: Sequence[bytes], index: int) -> list[bytes]:
    """Audit path for leaf ``index`` (RFC 6962 section 2.1.1), leaf-to-root order."""
    n = len(hashes)
    if not 0 <= index < n:
        raise IndexError(f"leaf index {index} out of range for {n} leaves")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return [*inclusion_path(hashes[:k], index), merkle_root(hashes[k:])]
    return [*inclusion_path(hashes[k:], index - k), merkle_root(hashes[:k])]


def verify_inclusion(
    leaf: bytes, index: int, size: int, path: Sequence[bytes], root: bytes
) -> bool:
    """Check an RFC 6962 audit path for ``leaf`` at ``index`` in a tree of ``size``."""
    return _root_from_path(leaf, index, size, path) == root


@dataclass(frozen=True)
class LeafSpec:
    """Path, dtype and shape of one tensor leaf: what its digest binds besides the bytes."""

    path: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def header(self) -> bytes:
        return _header(self.path, self.dtype, tuple(self.shape))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeafSpec:
        return cls(str(data["path"]), str(data["dtype"]), tuple(int(d) for d in data["shape"]))

    @classmethod
    def of(cls, path: str, array: np.ndarray) -> LeafSpec:
        return _spec(path, _dtype_name(array.dtype), array.shape)


# A run commits the same leaves every step: their specs and headers are built once
# (numpy's dtype names and the CBOR encoding were most of the per-leaf cost of a commit).
@functools.lru_cache(maxsize=1 << 16)
def _spec(path: str, dtype: str, shape: tuple[int, ...]) -> LeafSpec:
    return LeafSpec(path, dtype, tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=1 << 16)
def _header(path: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    return cbor2.dumps([path, dtype, list(shape)], canonical=True)


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype[Any]) -> str:
    # ml_dtypes (bfloat16, float8) report names numpy itself does not know; keep them.
    return str(dtype.name)


def tensor_digest(spec: LeafSpec, chunk_root: bytes) -> bytes:
    h = _tensor_primed(spec).copy()
    h.update(chunk_root)
    return h.digest()


@functools.lru_cache(maxsize=1 << 16)
def _tensor_primed(spec: LeafSpec) -> blake3.blake3:
    """A ``tensor`` hasher that has absorbed ``spec``'s header (a run's specs repeat)."""
    h = hasher(Domain.TENSOR)
    h.update(spec.header())
    return h


def _as_bytes(array: np.ndarray) -> memoryview:
    if array.flags.c_contiguous and array.dtype.byteorder != ">":
        return array.reshape(-1).view(np.uint8).data
    contiguous = np.ascontiguousarray(array)
    if contiguous.dtype.byteorder == ">":
        contiguous = contiguous.byteswap().view(contiguous.dtype.newbyteorder("<"))
    return contiguous.reshape(-1).view(np.uint8).data


# Below this a state is hashed on the calling thread: the pool's hand-offs cost more than
# they save (a 3.5 MiB state of 44 leaves: 1.2 ms serial, 1.7 ms through the pool).
_PARALLEL_MIN_BYTES = 4 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = int(os.environ.get("ZKDV_HASH_THREADS", "0")) or (os.cpu_count() or 1)
            _POOL = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="zkdv-hash", initializer=demote
            )
        return _POOL


def _hash_chunks(view: memoryview, chunk_bytes: int, start: int, stop: int) -> list[bytes]:
    return [
        leaf_hash(view[index * chunk_bytes : (index + 1) * chunk_bytes])
        for index in range(start, stop)
    ]


def _hash_segments(
    views: Sequence[memoryview], chunk_bytes: int, segments: Sequence[tuple[int, int, int]]
) -> list[tuple[int, list[bytes]]]:
    return [
        (leaf, _hash_chunks(views[leaf], chunk_bytes, start, stop))
        for leaf, start, stop in segments
    ]


def _chunk_root(view: memoryview, chunk_bytes: int) -> bytes:
    """The root of one leaf's chunk tree (a leaf of one chunk: that chunk's hash)."""
    if len(view) <= chunk_bytes:
        return leaf_hash(view)
    return merkle_root(_hash_chunks(view, chunk_bytes, 0, -(-len(view) // chunk_bytes)))


def chunk_hashes(array: np.ndarray, chunk_bytes: int) -> list[bytes]:
    """Hashes of every chunk of one leaf (single-threaded; see :func:`commit_state`)."""
    view = _as_bytes(array)
    count = max(1, -(-len(view) // chunk_bytes))
    return _hash_chunks(view, chunk_bytes, 0, count)


@dataclass(frozen=True)
class StateCommitment:
    """Root of a state tree plus what is needed to open coordinates of it later."""

    root: bytes
    specs: tuple[LeafSpec, ...]
    tensor_digests: tuple[bytes, ...]
    chunk_roots: tuple[bytes, ...]

    @property
    def size(self) -> int:
        """Total number of coordinates (elements) over all leaves."""
        return sum(spec.size for spec in self.specs)


def state_root(specs: Sequence[LeafSpec], tensor_digests: Sequence[bytes]) -> bytes:
    # The state root binds the number of leaves too, so an empty and a one-leaf state
    # whose digest equals H_leaf(b"") cannot collide.
    return hash_bytes(
        Domain.STATE, struct.pack("<Q", len(specs)), merkle_root(list(tensor_digests))
    )


def commit_state(
    leaves: Sequence[tuple[str, np.ndarray]], chunk_bytes: int, *, parallel: bool = True
) -> StateCommitment:
    """Commit to every byte of every leaf: what is hashed is never sampled.

    Args:
        leaves: ``(path, host array)`` pairs in the state's canonical order.
        chunk_bytes: Merkle chunk size (a power of two).
        parallel: hash chunks on the shared thread pool.
    """
    return start_commit(leaves, chunk_bytes, parallel=parallel).result()


def start_commit(
    leaves: Sequence[tuple[str, np.ndarray]], chunk_bytes: int, *, parallel: bool = True
) -> PendingCommitment:
    """:func:`commit_state`, with the caller free while the shared pool hashes.

    A state below the pool's threshold (or ``parallel=False``) is hashed here, before
    this returns. The arrays must not change until :meth:`PendingCommitment.result`
    (or :meth:`~PendingCommitment.wait`) returns.
    """
    specs = tuple(LeafSpec.of(path, array) for path, array in leaves)
    views = [_as_bytes(array) for _, array in leaves]
    total_bytes = sum(len(view) for view in views)
    workers = _pool()._max_workers if parallel else 1
    if workers == 1 or total_bytes < _PARALLEL_MIN_BYTES:
        roots = tuple(_chunk_root(view, chunk_bytes) for view in views)
        return PendingCommitment(specs, chunk_roots=roots)
    counts = [max(1, -(-len(view) // chunk_bytes)) for view in views]
    # Spread the bytes evenly: about two tasks per worker, each a run of chunk ranges
    # that may span several leaves, so that a state of many small leaves costs a few
    # pool submissions rather than one per leaf.
    target = -(-total_bytes // (workers * 2))
    tasks: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    for leaf, view in enumerate(views):
        start = 0
        while start < counts[leaf]:
            room = max(1, -(-(target - filled) // chunk_bytes))
            stop = min(counts[leaf], start + room)
            tasks[-1].append((leaf, start, stop))
            filled += min(len(view), stop * chunk_bytes) - start * chunk_bytes
            start = stop
            if filled >= target:
                tasks.append([])
                filled = 0
    futures = [_pool().submit(_hash_segments, views, chunk_bytes, task) for task in tasks if task]
    return PendingCommitment(specs, futures)


class PendingCommitment:
    """A state's commitment while the shared pool hashes it (:func:`start_commit`)."""

    def __init__(
        self,
        specs: tuple[LeafSpec, ...],
        futures: Sequence[Future[list[tuple[int, list[bytes]]]]] = (),
        chunk_roots: tuple[bytes, ...] | None = None,
    ) -> None:
        self.specs = specs
        self._futures = futures
        self._commitment: StateCommitment | None = None
        if chunk_roots is not None:
            self._finish(chunk_roots)

    def result(self) -> StateCommitment:
        """The commitment, once every chunk is hashed; raises what a hashing task raised."""
        if self._commitment is None:
            per_leaf: list[list[bytes]] = [[] for _ in self.specs]
            with waiting():
                for future in self._futures:
                    for leaf, hashes in future.result():
                        per_leaf[leaf].extend(hashes)
            self._futures = ()
            self._finish(tuple(merkle_root(hashes) for hashes in per_leaf))
        assert self._commitment is not None
        return self._commitment

    def wait(self) -> None:
        """Return once no task reads the arrays any more, whatever they raised."""
        with waiting():
            futures_wait(self._futures)

    def _finish(self, chunk_roots: tuple[bytes, ...]) -> None:
        specs = self.specs
        digests = tuple(
            tensor_digest(spec, root) for spec, root in zip(specs, chunk_roots, strict=True)
        )
        self._commitment = StateCommitment(state_root(specs, digests), specs, digests, chunk_roots)


@dataclass(frozen=True)
class ChunkOpening:
    chunk_index: int
    chunk_count: int
    chunk: bytes
    chunk_path: tuple[bytes, ...]


@dataclass(frozen=True)
class CoordinateOpening:
    """Everything needed to check one coordinate of a state against its root."""

    flat_index: int
    leaf_index: int
    element: int
    spec: LeafSpec
    chunk: ChunkOpening
    leaf_count: int
    tensor_path: tuple[bytes, ...]
    chunk_bytes: int

    def value(self) -> float:
        itemsize = np.dtype(self.spec.dtype).itemsize
        offset = (self.element * itemsize) % self.chunk_bytes
        raw = self.chunk.chunk[offset : offset + itemsize]
        return float(np.frombuffer(raw, dtype=np.dtype(self.spec.dtype).newbyteorder("<"))[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "flat_index": self.flat_index,
            "leaf_index": self.leaf_index,
            "element": self.element,
            "spec": self.spec.to_dict(),
            "chunk_index": self.chunk.chunk_index,
            "chunk_count": self.chunk.chunk_count,
            "chunk": self.chunk.chunk,
            "chunk_path": list(self.chunk.chunk_path),
            "leaf_count": self.leaf_count,
            "tensor_path": list(self.tensor_path),
            "chunk_bytes": self.chunk_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CoordinateOpening:
        return cls(
            flat_index=int(data["flat_index"]),
            leaf_index=int(data["leaf_index"]),
            element=int(data["element"]),
            spec=LeafSpec.from_dict(data["spec"]),
            chunk=ChunkOpening(
                int(data["chunk_index"]),
                int(data["chunk_count"]),
                bytes(data["chunk"]),
                tuple(bytes(p) for p in data["chunk_path"]),
            ),
            leaf_count=int(data["leaf_count"]),
            tensor_path=tuple(bytes(p) for p in data["tensor_path"]),
            chunk_bytes=int(data["chunk_bytes"]),
        )


def locate(specs: Sequence[LeafSpec], flat_index: int) -> tuple[int, int]:
    """Map a flat coordinate over all leaves (in order) to ``(leaf, element)``."""
    if flat_index < 0:
        raise IndexError(f"coordinate {flat_index} is negative")
    remaining = flat_index
    for leaf, spec in enumerate(specs):
        if remaining < spec.size:
            return leaf, remaining
        remaining -= spec.size
    raise IndexError(
        f"coordinate {flat_index} is beyond the state's {flat_index - remaining} elements"
    )


def open_coordinate(
    leaves: Sequence[tuple[str, np.ndarray]], flat_index: int, chunk_bytes: int
) -> CoordinateOpening:
    """Open one coordinate: its chunk and the chunk and tensor audit paths."""
    specs = [LeafSpec.of(path, array) for path, array in leaves]
    leaf, element = locate(specs, flat_index)
    array = leaves[leaf][1]
    hashes = chunk_hashes(array, chunk_bytes)
    chunk_index = element * np.dtype(specs[leaf].dtype).itemsize // chunk_bytes
    view = _as_bytes(array)
    chunk = bytes(view[chunk_index * chunk_bytes : (chunk_index + 1) * chunk_bytes])
    digests = [
        tensor_digest(spec, merkle_root(chunk_hashes(arr, chunk_bytes)))
        for spec, (_, arr) in zip(specs, leaves, strict=True)
    ]
    return CoordinateOpening(
        flat_index=flat_index,
        leaf_index=leaf,
        element=element,
        spec=specs[leaf],
        chunk=ChunkOpening(
            chunk_index, len(hashes), chunk, tuple(inclusion_path(hashes, chunk_index))
        ),
        leaf_count=len(specs),
        tensor_path=tuple(inclusion_path(digests, leaf)),
        chunk_bytes=chunk_bytes,
    )


def verify_opening(
    root: bytes, opening: CoordinateOpening, *, specs: Sequence[LeafSpec] | None = None
) -> bool:
    """True when ``opening`` proves its chunk (and so its coordinate) under ``root``.

    Args:
        specs: the state's schema (from the transcript's root record). With it, the
            opening must also sit exactly at ``opening.flat_index``; without it only
            the chunk's membership under ``root`` is checked.
    """
    if specs is not None:
        try:
            located = locate(specs, opening.flat_index)
        except IndexError:
            return False
        if (
            located != (opening.leaf_index, opening.element)
            or specs[opening.leaf_index] != opening.spec
        ):
            return False
        if opening.leaf_count != len(specs):
            return False
    spec = opening.spec
    if not 0 <= opening.element < spec.size:
        return False
    itemsize = np.dtype(spec.dtype).itemsize
    expected_chunk = opening.element * itemsize // opening.chunk_bytes
    if opening.chunk.chunk_index != expected_chunk:
        return False
    expected_count = max(1, -(-spec.nbytes // opening.chunk_bytes))
    if opening.chunk.chunk_count != expected_count:
        return False
    expected_length = min(opening.chunk_bytes, spec.nbytes - expected_chunk * opening.chunk_bytes)
    if len(opening.chunk.chunk) != max(0, expected_length):
        return False
    # Rebuild the chunk root from the audit path, then the tensor digest, then the root.
    chunk_root = _root_from_path(
        leaf_hash(opening.chunk.chunk),
        opening.chunk.chunk_index,
        opening.chunk.chunk_count,
        opening.chunk.chunk_path,
    )
    if chunk_root is None:
        return False
    digest = tensor_digest(spec, chunk_root)
    tensors_root = _root_from_path(
        digest, opening.leaf_index, opening.leaf_count, opening.tensor_path
    )
    if tensors_root is None:
        return False
    return hash_bytes(Domain.STATE, struct.pack("<Q", opening.leaf_count), tensors_root) == root


def _root_from_path(leaf: bytes, index: int, size: int, path: Sequence[bytes]) -> bytes | None:
    """Recompute a root from an audit path (RFC 9162 section 2.1.3.2), or None if malformed."""
    if not 0 <= index < size:
        return None
    fn, sn = index, size - 1
    result = leaf
    for sibling in path:
        if len(sibling) != DIGEST_BYTES or sn == 0:
            return None
        if fn & 1 or fn == sn:
            result = _node(sibling, result)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            result = _node(result, sibling)
        fn >>= 1
        sn >>= 1
    return result if sn == 0 else None
