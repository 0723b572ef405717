"""What the lab sends for one sliced challenge: its projections, then the openings.

:class:`SliceAnswer` is the lab's first reply (every sequence's projections);
:class:`SliceOpening` what it opens once the platform has drawn the sequences: whole
tensors with their audit paths (:class:`TensorOpening`), post-update audit paths
(:class:`DigestPath`), boundary rows (:class:`RowOpening`) and, for the input check,
committed batch rows (:class:`BatchRowOpening`). Each opening verifies itself against
the root it was committed under.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from zkdv.hashing import DIGEST_BYTES, Domain, hasher
from zkdv.merkle import (
    LeafSpec,
    StateCommitment,
    chunk_hashes,
    inclusion_path,
    merkle_root,
    tensor_digest,
    verify_inclusion,
)
from zkdv.sliced._commitment import _KINDS, Leaves, _batch_leaf, _hash, _row_index, _row_leaf


@dataclass(frozen=True)
class TensorOpening:
    """One whole tensor leaf of a state tree, with the audit path of its digest.

    ``tensors_root`` is the root of the tree of tensor digests; the state root is
    ``H_state(u64le(count) || tensors_root)``, so it is bound by the root it is checked
    against.
    """

    index: int
    count: int
    spec: LeafSpec
    data: bytes
    path: tuple[bytes, ...]
    tensors_root: bytes

    def array(self) -> np.ndarray:
        dtype = np.dtype(self.spec.dtype).newbyteorder("<")
        return (
            np.frombuffer(self.data, dtype=dtype).reshape(self.spec.shape).astype(self.spec.dtype)
        )

    def verify(self, root: bytes, chunk_bytes: int) -> bool:
        """True when the bytes hash, through the tensor and state trees, to ``root``."""
        if len(self.data) != self.spec.nbytes:
            return False
        digest = tensor_digest(self.spec, merkle_root(chunk_hashes(self.array(), chunk_bytes)))
        return _under(root, self.count, self.tensors_root) and verify_inclusion(
            digest, self.index, self.count, self.path, self.tensors_root
        )

    @property
    def nbytes(self) -> int:
        return len(self.data) + DIGEST_BYTES * (len(self.path) + 1) + len(self.spec.header())


@dataclass(frozen=True)
class DigestPath:
    """A tensor digest's audit path in a post-update tree (the platform computes the bytes)."""

    index: int
    count: int
    path: tuple[bytes, ...]
    tensors_root: bytes

    def verify(self, root: bytes, spec: LeafSpec, array: np.ndarray, chunk_bytes: int) -> bool:
        digest = tensor_digest(spec, merkle_root(chunk_hashes(array, chunk_bytes)))
        return _under(root, self.count, self.tensors_root) and verify_inclusion(
            digest, self.index, self.count, self.path, self.tensors_root
        )

    @property
    def nbytes(self) -> int:
        return DIGEST_BYTES * (len(self.path) + 1)


def _under(root: bytes, count: int, tensors_root: bytes) -> bool:
    # The same wrapping as zkdv.merkle.state_root, from the tree root rather than digests.
    h = hasher(Domain.STATE)
    h.update(struct.pack("<Q", count))
    h.update(tensors_root)
    return h.digest() == root


@dataclass(frozen=True)
class RowOpening:
    """One boundary row (one sequence's activation or gradient) and its audit path."""

    micro: int
    boundary: int
    kind: str
    row: int
    data: np.ndarray
    path: tuple[bytes, ...]

    def verify(self, root: bytes, shape: tuple[int, int, int]) -> bool:
        micro_batches, boundaries, rows = shape
        if not (
            0 <= self.micro < micro_batches
            and 0 <= self.boundary < boundaries
            and 0 <= self.row < rows
            and self.kind in _KINDS
        ):
            return False
        index = _row_index(self.micro, self.boundary, self.kind, self.row, (boundaries, rows))
        leaf = _row_leaf(self.micro, self.boundary, self.kind, self.row, self.data)
        return verify_inclusion(leaf, index, micro_batches * boundaries * 2 * rows, self.path, root)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + DIGEST_BYTES * len(self.path)


@dataclass(frozen=True)
class BatchRowOpening:
    """One committed batch row (a sequence's tokens) and its audit path."""

    micro: int
    row: int
    data: np.ndarray
    path: tuple[bytes, ...]

    def verify(self, root: bytes, shape: tuple[int, int, int]) -> bool:
        micro_batches, _, rows = shape
        if not (0 <= self.micro < micro_batches and 0 <= self.row < rows):
            return False
        leaf = _batch_leaf(self.micro, self.row, self.data)
        index = self.micro * rows + self.row
        return verify_inclusion(leaf, index, micro_batches * rows, self.path, root)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + DIGEST_BYTES * len(self.path)


def _open_tensor(commitment: StateCommitment, leaves: Leaves, index: int) -> TensorOpening:
    digests = list(commitment.tensor_digests)
    array = np.ascontiguousarray(leaves[index][1])
    return TensorOpening(
        index=index,
        count=len(digests),
        spec=commitment.specs[index],
        data=array.astype(array.dtype.newbyteorder("<")).tobytes(),
        path=tuple(inclusion_path(digests, index)),
        tensors_root=merkle_root(digests),
    )


def _digest_path(commitment: StateCommitment, index: int) -> DigestPath:
    digests = list(commitment.tensor_digests)
    return DigestPath(
        index, len(digests), tuple(inclusion_path(digests, index)), merkle_root(digests)
    )


@dataclass(frozen=True)
class SliceAnswer:
    """The lab's first reply: ``c[q][micro][row] = <R_q, G_(micro,row)>`` for every sequence."""

    projections: np.ndarray  # float64, (projections, micro_batches, rows)

    def digest(self) -> bytes:
        data = np.ascontiguousarray(self.projections, dtype="<f8")
        return _hash(b"zkdv-sliced-v0 answer", struct.pack("<3Q", *data.shape), data.tobytes())

    @property
    def nbytes(self) -> int:
        return int(self.projections.nbytes)


@dataclass(frozen=True)
class SliceOpening:
    """Everything the platform reads for one sliced challenge, after the sequences are drawn."""

    params: tuple[TensorOpening, ...]
    opt_state: tuple[TensorOpening, ...]
    grad: tuple[TensorOpening, ...]
    post_params: tuple[DigestPath, ...]
    post_opt_state: tuple[DigestPath, ...]
    rows: tuple[RowOpening, ...]
    #: The input check (a lab with ``inputs``): the embedding's tensors and the opened
    #: sequences' batch rows; ``rows`` then also holds their boundary-0 activations.
    inputs: tuple[TensorOpening, ...] = ()
    batch_rows: tuple[BatchRowOpening, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes moved: tensor and row bytes plus every audit path."""
        return (
            sum(t.nbytes for t in (*self.params, *self.opt_state, *self.grad, *self.inputs))
            + sum(p.nbytes for p in (*self.post_params, *self.post_opt_state))
            + sum(r.nbytes for r in self.rows)
            + sum(r.nbytes for r in self.batch_rows)
        )
