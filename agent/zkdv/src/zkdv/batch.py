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

from zkdv._numba import jit
from zkdv.config import TOKEN_UNITS
from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import merkle_root

__all__ = [
    "TOKEN_UNITS",
    "BatchCommitment",
    "commit_batch",
    "compiled_pass",
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


# --- The compiled pass (Numba) -------------------------------------------------------------

#: Set to ``0`` to fingerprint and sort with numpy even where Numba is installed.
JIT_ENV = "ZKDV_BATCH_JIT"
#: Batches of at most this many fingerprints are sorted by numpy, without building the
#: compiled pass: loading Numba and its cached kernel costs a process about 1.2 s, and each
#: replay child of the platform commits one challenged batch. At that size numpy took
#: 1.8 ms and the pass 2.2 ms (``bench/commit_throughput.py`` compares the two).
SMALL_BATCH_FINGERPRINTS = 1 << 16
_kernel_state: dict[str, Any] = {}
_DIGIT_BITS = 11  # six passes cover 64 bits; 2,048 counters per digit stay in L1
_DIGITS = -(-64 // _DIGIT_BITS)


def _kernel() -> Any:
    """The compiled pass, or None without Numba (or with ``ZKDV_BATCH_JIT=0``)."""
    return jit(_kernel_state, JIT_ENV, _sorted_pass, _try_pass)


def compiled_pass() -> bool:
    """Whether :func:`commit_batch` fingerprints and sorts with the compiled pass here.

    An internal API: ``bench/commit_throughput.py`` asks it before timing the compiled
    pass against numpy (:data:`JIT_ENV`).
    """
    return _kernel() is not None


def _try_pass(kernel: Any) -> None:
    rows = np.arange(12, dtype=np.uint32).reshape(2, 6) * np.uint32(2654435761)
    out, scratch = np.empty(8, np.uint64), np.empty(8, np.uint64)
    passes = kernel(rows, 3, _BASE, _MIX, out, scratch)
    got = out if passes % 2 == 0 else scratch
    if not np.array_equal(got, np.sort(window_fingerprints(rows, 3), axis=None)):
        raise ArithmeticError("the compiled fingerprints differ from numpy's")


def _sorted_pass(
    rows: np.ndarray,
    window: int,
    base: np.uint64,
    mix: np.uint64,
    out: np.ndarray,
    scratch: np.ndarray,
) -> int:  # pragma: no cover - compiled by Numba (its output is tested against numpy's)
    """:func:`window_fingerprints` into ``out``, then sorted; returns the number of
    scatter passes (even: the result is in ``out``, odd: in ``scratch``)."""
    count = rows.shape[1] - window + 1
    one = np.uint64(1)
    k = 0
    for r in range(rows.shape[0]):
        for j in range(count):
            # The same Horner's rule and finaliser as window_fingerprints, word by word.
            acc = np.uint64(rows[r, j]) + one
            for w in range(1, window):
                acc = acc * base + (np.uint64(rows[r, j + w]) + one)
            acc ^= acc >> np.uint64(31)
            acc *= mix
            acc ^= acc >> np.uint64(29)
            out[k] = acc
            k += 1
    n = out.size
    radix = 1 << _DIGIT_BITS
    mask = np.uint64(radix - 1)
    counts = np.zeros((_DIGITS, radix), np.int64)
    for i in range(n):
        x = out[i]
        for d in range(_DIGITS):
            counts[d, (x >> np.uint64(_DIGIT_BITS * d)) & mask] += 1
    source, target = out, scratch
    passes = 0
    for d in range(_DIGITS):
        digit = counts[d]
        if digit.max() == n:  # every key has the same digit here: nothing moves
            continue
        total = 0
        for b in range(radix):
            c = digit[b]
            digit[b] = total
            total += c
        shift = np.uint64(_DIGIT_BITS * d)
        for i in range(n):
            x = source[i]
            b = (x >> shift) & mask
            target[digit[b]] = x
            digit[b] += 1
        source, target = target, source
        passes += 1
    return passes


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

    In one compiled pass where Numba is installed (``zkdv[jit]``): the fingerprints, then
    an LSD radix sort of their 64-bit words in place of numpy's comparison sort, which
    took most of a wide batch's commitment (``bench/commit_throughput.py`` times both).
    Sorting integers has one answer, so both paths give the same array
    (``tests/agent/zkdv/test_batch.py``).
    """
    array = as_batch(rows)
    validate_window(rolling_window, array.shape[1])
    count = array.shape[0] * (array.shape[1] - rolling_window + 1)
    # A small batch never builds the pass (SMALL_BATCH_FINGERPRINTS).
    kernel = _kernel() if count > SMALL_BATCH_FINGERPRINTS else None
    if kernel is None:
        return np.sort(window_fingerprints(array, rolling_window), axis=None)
    return _sorted_by(kernel, array, rolling_window)


def compiled_sort(array: np.ndarray, rolling_window: int) -> np.ndarray:
    """:func:`sorted_fingerprints` by the compiled pass at any size, for the test and the
    bench that compare it with numpy (an internal API; see :func:`compiled_pass`).

    Raises:
        RuntimeError: there is no compiled pass here.
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("no compiled pass: Numba is missing, refused, or ZKDV_BATCH_JIT=0")
    return _sorted_by(kernel, as_batch(array), rolling_window)


def _sorted_by(kernel: Any, array: np.ndarray, rolling_window: int) -> np.ndarray:
    count = array.shape[0] * (array.shape[1] - rolling_window + 1)
    out, scratch = np.empty(count, np.uint64), np.empty(count, np.uint64)
    passes = kernel(array, rolling_window, _BASE, _MIX, out, scratch)
    return out if passes % 2 == 0 else scratch


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
