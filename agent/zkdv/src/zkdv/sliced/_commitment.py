"""What the lab commits for a step of a sliced run, before any challenge names it.

The step commitment (:class:`StepCommitment`: the state, gradient, boundary and batch
roots), the block layout it is sliced by, the side file's digest that binds a run's
commitments, and the leaves of the two trees this protocol adds to the transcript's: one
per boundary row (:func:`row_leaves`, in :func:`_row_index` order) and one per committed
batch row (:func:`batch_leaves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import cbor2
import numpy as np

from zkdv.hashing import Domain, hasher

SLICED_VERSION = "zkdv-sliced-v0"
#: The two kinds of boundary row: the activation, and the loss gradient with respect to it.
ACTIVATION, GRADIENT = "act", "grad"
_KINDS = (ACTIVATION, GRADIENT)

# Boundary rows hash under their own key, so a row can never pass for a state chunk or a
# batch row (the protocol's other leaves); derived as zkdv.hashing derives its keys.
_ROW_KEY = blake3.blake3(b"zkdv-protocol-v1", derive_key_context="zkdv v1 sliced-row").digest()

Leaves = list[tuple[str, np.ndarray]]


def _row_leaf(micro: int, boundary: int, kind: str, row: int, data: np.ndarray) -> bytes:
    """The leaf of one boundary row: its position and shape are bound with its bytes."""
    header = cbor2.dumps(
        [micro, boundary, kind, row, str(data.dtype), list(data.shape)], canonical=True
    )
    h = blake3.blake3(key=_ROW_KEY)
    h.update(header)
    h.update(np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
    return h.digest()


def _batch_leaf(micro: int, row: int, data: np.ndarray) -> bytes:
    """The leaf of one committed batch row (a sequence's tokens)."""
    header = cbor2.dumps(["batch", micro, row, str(data.dtype), list(data.shape)], canonical=True)
    h = blake3.blake3(key=_ROW_KEY)
    h.update(header)
    h.update(np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
    return h.digest()


def _row_index(micro: int, boundary: int, kind: str, row: int, shape: tuple[int, int]) -> int:
    boundaries, rows = shape
    return ((micro * boundaries + boundary) * 2 + _KINDS.index(kind)) * rows + row


@dataclass(frozen=True)
class BlockLayout:
    """Which parameters make up each block, in the model's committed parameter order.

    Block ``b`` reads boundary ``b`` and writes boundary ``b + 1``; boundary 0 is the
    first block's input.
    """

    blocks: tuple[tuple[str, tuple[str, ...]], ...]

    def names(self, block: int) -> tuple[str, ...]:
        return self.blocks[block][1]

    @property
    def count(self) -> int:
        return len(self.blocks)


def optimizer_paths(name: str) -> tuple[str, str, str]:
    """The optimizer-state leaves of one Adam parameter, in committed order."""
    return (f"{name}.exp_avg", f"{name}.exp_avg_sq", f"{name}.step")


@dataclass(frozen=True)
class StepCommitment:
    """What the lab commits for one step before any challenge can name it.

    ``pre`` and ``post`` are the roots of the parameters and the optimizer state
    (:func:`zkdv.merkle.commit_state`, the transcript's construction); ``grad`` the
    committed gradient's; ``boundary`` the root over every boundary row of every
    micro-batch; ``batch`` the root over the batch's rows (one sequence's tokens each,
    index ``micro * rows + row``); ``shape`` is ``(micro_batches, boundaries, rows)``.
    """

    step: int
    pre: tuple[bytes, bytes]
    post: tuple[bytes, bytes]
    grad: bytes
    boundary: bytes
    batch: bytes
    shape: tuple[int, int, int]
    hp: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "i": self.step,
            "pre": list(self.pre),
            "post": list(self.post),
            "grad": self.grad,
            "boundary": self.boundary,
            "batch": self.batch,
            "shape": list(self.shape),
            "hp": dict(self.hp),
        }

    def digest(self) -> bytes:
        return _hash(b"zkdv-sliced-v0 step", cbor2.dumps(self.to_dict(), canonical=True))


def _hash(label: bytes, *parts: bytes) -> bytes:
    h = hasher(Domain.FILE)
    h.update(label)
    for part in parts:
        h.update(part)
    return h.digest()


def side_file_digest(layout: BlockLayout, steps: Sequence[StepCommitment]) -> bytes:
    """The digest that binds a run's sliced commitments (a transcript would record it)."""
    body = cbor2.dumps(
        {
            "v": SLICED_VERSION,
            "blocks": [[name, list(names)] for name, names in layout.blocks],
            "steps": [step.to_dict() for step in steps],
        },
        canonical=True,
    )
    return _hash(b"zkdv-sliced-v0 side file", body)


def batch_leaves(batch: np.ndarray) -> list[bytes]:
    """Every batch row's leaf, micro-batch by micro-batch."""
    return [
        _batch_leaf(micro, row, batch[micro, row])
        for micro in range(batch.shape[0])
        for row in range(batch.shape[1])
    ]


def row_leaves(boundaries: list[list[dict[str, np.ndarray]]]) -> list[bytes]:
    """Every boundary row's leaf, in :func:`_row_index` order."""
    out = []
    for micro, per_boundary in enumerate(boundaries):
        for boundary, kinds in enumerate(per_boundary):
            for kind in _KINDS:
                for row, data in enumerate(kinds[kind]):
                    out.append(_row_leaf(micro, boundary, kind, row, data))
    return out
