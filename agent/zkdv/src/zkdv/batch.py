"""Batch commitments: a rectangular uint32 array, one hash per row, rolling-window fingerprints.

The committed batch is a ``(rows, cols)`` uint32 array (the JAX contrib lowering packs
every dynamic non-state input into one losslessly). Each row is hashed; the row hashes
form a Merkle tree whose root is the batch root.

For data-content queries ("did this token sequence appear in training?") every window of
``rolling_window`` consecutive words of every row gets a 64-bit keyed fingerprint,
computed for all windows at once with a polynomial rolling hash (vectorised, so a batch
of 8,192 tokens costs well under a millisecond). The step record commits the digest of
the sorted fingerprint multiset; the platform, which holds the batch files, answers a
query by recomputing fingerprints and never reveals the data itself.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from zkdv.config import TOKEN_UNITS
from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import merkle_root

__all__ = [
    "TOKEN_UNITS",
    "BatchCommitment",
    "commit_batch",
    "count_tokens",
    "sorted_fingerprints",
    "validate_window",
    "window_fingerprints",
]


# Keyed multipliers of the rolling hash: odd 64-bit constants derived from the window key,
# so fingerprints of a transcript cannot be precomputed without knowing the protocol.
_SEED = hash_bytes(Domain.WINDOW, b"multipliers", length=16)
_BASE = np.uint64(int.from_bytes(_SEED[:8], "little") | 1)
_MIX = np.uint64(int.from_bytes(_SEED[8:], "little") | 1)


def count_tokens(leaves: Any, unit: str) -> int:
    """A step's ``tokens`` in ``unit`` (:data:`zkdv.config.TOKEN_UNITS`) from its batch.

    Args:
        leaves: ``(shape, dtype)`` of each dynamic batch input, in argument order; the
            dtype as its name (``"int32"``, ``"bfloat16"``, a Torch dtype's name after
            ``torch.``).
        unit: ``"examples"`` or ``"tokens"``.

    Raises:
        ValueError: ``unit`` is unknown, or ``"tokens"`` and no integer input has rank
            >= 2 (declare ``token_unit="examples"``, or pass the token ids).
    """
    shapes = [
        (tuple(int(d) for d in shape), str(dtype).removeprefix("torch.")) for shape, dtype in leaves
    ]
    if unit == "examples":
        return next((shape[0] for shape, _ in shapes if len(shape) >= 1), 1)
    if unit == "tokens":
        for shape, dtype in shapes:
            if len(shape) >= 2 and dtype in _INTEGER_DTYPES:
                return math.prod(shape)
        found = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in shapes) or "nothing"
        raise ValueError(
            "token_unit='tokens' counts the elements of the batch's first integer array of "
            f"rank >= 2 (its token ids), and the batch holds {found}; declare "
            "ZKDVConfig(token_unit='examples') for a model that does not train on token ids"
        )
    raise ValueError(f"token_unit must be one of {', '.join(map(repr, TOKEN_UNITS))}, got {unit!r}")


_INTEGER_DTYPES = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))


def validate_window(rolling_window: int, cols: int) -> None:
    if (
        not isinstance(rolling_window, int)
        or isinstance(rolling_window, bool)
        or rolling_window < 1
    ):
        raise ValueError(f"rolling_window={rolling_window!r} must be a positive integer")
    if rolling_window > cols:
        raise ValueError(
            f"rolling_window={rolling_window} exceeds the committed batch row width of {cols} "
            "uint32 words; choose a window no wider than one packed batch row"
        )


def as_batch(batch: Any) -> np.ndarray:
    """Validate and return the committed batch as a C-contiguous 2-D uint32 array."""
    array = np.asarray(batch)
    if array.dtype != np.uint32:
        raise TypeError(f"the committed batch must be uint32, got {array.dtype}")
    if array.ndim == 1:
        array = array.reshape(1, -1)
    if array.ndim != 2:
        raise ValueError(
            f"the committed batch must be a 2-D (rows, cols) array, got shape {array.shape}"
        )
    if array.shape[1] == 0:
        raise ValueError("the committed batch rows are empty")
    return np.ascontiguousarray(array)


def window_fingerprints(rows: np.ndarray, rolling_window: int) -> np.ndarray:
    """64-bit fingerprints of every window of ``rolling_window`` words in every row.

    Returns a ``(rows, cols - rolling_window + 1)`` uint64 array. Arithmetic is modulo
    2**64 (numpy's wrapping uint64), a keyed polynomial hash followed by a
    multiply-xorshift finaliser.
    """
    rows = np.asarray(rows, dtype=np.uint32)
    if rows.ndim == 1:
        rows = rows.reshape(1, -1)
    validate_window(rolling_window, rows.shape[1])
    words = rows.astype(np.uint64) + np.uint64(1)  # so that zero words still contribute
    count = words.shape[1] - rolling_window + 1
    with np.errstate(over="ignore"):
        # Horner's rule over shifted column slices: sum_k words[:, j + k] * BASE^(w-1-k)
        # for every window start j at once, in place, without a (rows, count, w) temporary
        # (the rolling window is short; the batch is wide).
        acc: np.ndarray = words[:, :count].copy()
        for k in range(1, rolling_window):
            acc *= _BASE
            acc += words[:, k : k + count]
        acc ^= acc >> np.uint64(31)
        acc *= _MIX
        acc ^= acc >> np.uint64(29)
    return acc


@dataclass(frozen=True)
class BatchCommitment:
    root: bytes
    rows: int
    cols: int
    windows: bytes

    def to_record(self) -> dict[str, Any]:
        return {"root": self.root, "rows": self.rows, "cols": self.cols, "win": self.windows}


def sorted_fingerprints(rows: np.ndarray, rolling_window: int) -> np.ndarray:
    """Every fingerprint of :func:`window_fingerprints`, flattened and sorted: the
    multiset the step record commits.

    numpy's sort, which dispatches to the CPU's vector sort. A compiled pass (the
    fingerprints and an LSD radix sort in one Numba loop) once replaced it; on an idle
    machine numpy's was 1.6 to 2.9 times faster at every size from 8,160 to 2,096,384
    fingerprints, and equal to 1.7 times faster with its AVX-512 sort turned off
    (``docs/performance.md``), so the pass and its Numba start were retired.
    """
    array = as_batch(rows)
    validate_window(rolling_window, array.shape[1])
    return np.sort(window_fingerprints(array, rolling_window), axis=None)


def commit_batch(batch: Any, rolling_window: int) -> BatchCommitment:
    """Commit to every word of ``batch`` and to the multiset of its window fingerprints."""
    array = as_batch(batch)
    rows, cols = array.shape
    validate_window(rolling_window, cols)
    row_hashes = [
        hash_bytes(Domain.BATCH, struct.pack("<QQ", r, cols), array[r].tobytes())
        for r in range(rows)
    ]
    fingerprints = sorted_fingerprints(array, rolling_window)
    windows = hash_bytes(Domain.WINDOW, struct.pack("<Q", rolling_window), fingerprints.tobytes())
    return BatchCommitment(merkle_root(row_hashes), int(rows), int(cols), windows)


def contains_window(batch: Any, window: Any) -> list[int]:
    """Rows of ``batch`` in which the token ``window`` occurs (exact, not only by fingerprint)."""
    array = as_batch(batch)
    needle = np.asarray(window, dtype=np.uint32).reshape(-1)
    fingerprints = window_fingerprints(array, needle.size)
    target = window_fingerprints(needle.reshape(1, -1), needle.size)[0, 0]
    rows, cols = np.nonzero(fingerprints == target)
    found = []
    for row, col in zip(rows.tolist(), cols.tolist(), strict=True):
        if np.array_equal(array[row, col : col + needle.size], needle) and row not in found:
            found.append(row)
    return found
