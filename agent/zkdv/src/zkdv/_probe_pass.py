"""The exact probes' compiled pass (Numba): :class:`zkdv.probes.ProbeSet` projects its
rows of one width class in one call of :func:`_kernel`, or with numpy where it is None."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from zkdv._numba import jit

# The same arithmetic as exact_rows, the products and exact_finish, two rows at a time in
# one compiled loop: every slice is the same integer, every product sum is exact in any
# order (zkdv.probes' docstring), and the finish is the same two float64 operations and
# rounding, so the bits are those of the numpy path (tests/agent/zkdv/test_probes.py
# compares both with exact rational arithmetic). It releases the interpreter lock while it
# runs, so the training thread keeps running Python beside the commit stage.
#
# The products are not a BLAS call: a probe has few columns (k = 1% of d), and a GEMM of
# a (2 * rows, d) block by a (d, k) matrix spends more time writing the slices to memory
# and reading them back than multiplying. The pass takes two rows at a time, four slices,
# and the probe columns four or two at a time (_dots_4x4, _dots_4x2): sixteen or eight
# sums that each load of a slice or a column feeds several times, as a BLAS micro-kernel
# keeps a block of its result in registers. (One column's two dot products at a time,
# the pass until 2026-12-05, loaded three values for two products and ran at the speed of
# the cache, not of the multipliers.) With few columns the slices are never stored: the
# dot products split the rows as they go. Vectorised: reassociating an exact sum cannot
# change it. Measured against the float64 products alone by bench/probe_cost.py.

#: Set to ``0`` to project with numpy even where Numba is installed.
JIT_ENV = "ZKDV_PROBES_JIT"
#: A projection of at most this many values takes the numpy path and never builds the
#: compiled pass (Numba's import and its cached kernels cost a process about 1.5 s). A
#: replay child of the platform projects a challenged step's rows of a small model once.
SMALL_PROJECTION_VALUES = 1 << 12
_kernel_state: dict[str, Any] = {}

#: What the dot products may reorder: their sums are exact in any order and their products
#: exact, so summing in vector lanes (``reassoc``) and fused multiply-adds (``contract``)
#: keep the bits; nothing else is relaxed (no reciprocal, no assumption about NaN or zeros).
EXACT_SUM_FASTMATH = frozenset({"reassoc", "contract"})

#: The pass's helpers and the ``fastmath`` flags each is compiled with: only the dot
#: products are relaxed; the split and the finish, whose roundings matter, are strict.
PASS_HELPERS: Mapping[str, frozenset[str]] = {
    "_changes": frozenset(),
    "_project_pair": frozenset(),
    "_scale": frozenset(),
    "_slices": frozenset(),
    "_split_row": frozenset(),
    "_dots_4x4": EXACT_SUM_FASTMATH,
    "_dots_4x2": EXACT_SUM_FASTMATH,
}


#: The pass's helpers that are inlined where it calls them (strict, like the pass).
PASS_INLINED = frozenset({"_changes", "_project_pair"})


def _kernel() -> Any:
    """The compiled pass, or None without Numba (or with ``ZKDV_PROBES_JIT=0``)."""
    return jit(
        _kernel_state, JIT_ENV, _project_pass, _try_pass, helpers=PASS_HELPERS, inline=PASS_INLINED
    )


def _try_pass(kernel: Any) -> None:
    out = np.empty((2, 1), dtype=np.float32)
    matrix = np.ones((1, padded_columns(1), 2), dtype=np.float64)
    earlier = np.zeros((1, 2), np.float32)
    kernel(np.ones((2, 2), np.float32), earlier, earlier, matrix, np.array([[0, 0, 2]]), 26, out)


def _scale(values: np.ndarray, width: int) -> float:  # pragma: no cover - compiled by Numba
    """exact_rows' scale of one float32 row, ``2**(w - e)`` for its peak ``|v| < 2**e``,
    or 0.0 for a row holding an infinity or NaN (its probe is NaN)."""
    # The peak magnitude from the bits: for float32, the order of the magnitudes is that
    # of the bits without the sign (an integer maximum, which vectorises); at or above an
    # infinity's it holds an inf or NaN.
    words = values.view(np.uint32)
    peak_bits = np.uint32(0)
    for i in range(len(words)):
        peak_bits = max(peak_bits, words[i] & np.uint32(0x7FFFFFFF))
    if peak_bits >= np.uint32(0x7F800000):
        return 0.0
    # The peak's frexp exponent from its exponent field: a normal peak is in
    # [2**(e - 127), 2**(e - 126)). Below the smallest normal the row holds only
    # subnormals and zeros, flushed to zero, and frexp(0) is (0, 0).
    exponent = int(peak_bits >> np.uint32(23))
    top = exponent - 126 if exponent > 0 else 0
    return math.ldexp(1.0, width - top)


def _slices(value: float, scale: float, unit: float) -> tuple[float, float]:
    """exact_rows' two slices of one element (compiled strictly: the roundings matter)."""
    v = np.float64(value)
    # Subnormals are flushed, as exact_rows does (in a row above its flush threshold they
    # make zero slices anyway).
    x = v * scale if abs(v) >= 2.0**-126 else 0.0  # exact: a power of two
    # Truncation toward zero through int64: |x| < 2**w, exact.
    whole = np.float64(np.int64(x))
    return whole, np.float64(np.int64((x - whole) * unit))


def _split_row(
    values: np.ndarray, scale: float, unit: float, high: np.ndarray, low: np.ndarray
) -> None:  # pragma: no cover - compiled by Numba
    """A float32 row's slices into ``high`` and ``low``."""
    for i in range(len(values)):
        high[i], low[i] = _slices(values[i], scale, unit)


# The dot products, sixteen or eight sums at a time: four slices (the high and low slices
# of two rows) against four or two probe columns q[j], q[j + 1]..., each load of a slice
# or a column feeding several sums. sums[4 * s + c] is slice s times column j + c. With
# ``split`` they split two float32 rows ``source[row]`` and ``source[other]`` as they go
# (_slices, which saves storing and loading the slices where a probe has few columns);
# without, they read four rows of slices split beforehand (``source``, (4, d) float64).


def _dots_4x4(
    source: np.ndarray,
    row: int,
    other: int,
    split: bool,
    scales: tuple[float, float, float],
    q: np.ndarray,
    j: int,
    sums: np.ndarray,
) -> None:  # pragma: no cover - compiled by Numba
    scale0, scale1, unit = scales
    q0, q1, q2, q3 = q[j], q[j + 1], q[j + 2], q[j + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = 0.0
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = 0.0
    for i in range(q.shape[1]):
        if split:
            x0, x1 = _slices(source[row, i], scale0, unit)
            x2, x3 = _slices(source[other, i], scale1, unit)
        else:
            x0, x1, x2, x3 = source[0, i], source[1, i], source[2, i], source[3, i]
        c0, c1, c2, c3 = q0[i], q1[i], q2[i], q3[i]
        a00, a01, a02, a03 = a00 + x0 * c0, a01 + x0 * c1, a02 + x0 * c2, a03 + x0 * c3
        a10, a11, a12, a13 = a10 + x1 * c0, a11 + x1 * c1, a12 + x1 * c2, a13 + x1 * c3
        a20, a21, a22, a23 = a20 + x2 * c0, a21 + x2 * c1, a22 + x2 * c2, a23 + x2 * c3
        a30, a31, a32, a33 = a30 + x3 * c0, a31 + x3 * c1, a32 + x3 * c2, a33 + x3 * c3
    sums[0], sums[1], sums[2], sums[3] = a00, a01, a02, a03
    sums[4], sums[5], sums[6], sums[7] = a10, a11, a12, a13
    sums[8], sums[9], sums[10], sums[11] = a20, a21, a22, a23
    sums[12], sums[13], sums[14], sums[15] = a30, a31, a32, a33


def _dots_4x2(
    source: np.ndarray,
    row: int,
    other: int,
    split: bool,
    scales: tuple[float, float, float],
    q: np.ndarray,
    j: int,
    sums: np.ndarray,
) -> None:  # pragma: no cover - compiled by Numba
    scale0, scale1, unit = scales
    q0, q1 = q[j], q[j + 1]
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = 0.0
    for i in range(q.shape[1]):
        if split:
            x0, x1 = _slices(source[row, i], scale0, unit)
            x2, x3 = _slices(source[other, i], scale1, unit)
        else:
            x0, x1, x2, x3 = source[0, i], source[1, i], source[2, i], source[3, i]
        c0, c1 = q0[i], q1[i]
        a00, a01, a10, a11 = a00 + x0 * c0, a01 + x0 * c1, a10 + x1 * c0, a11 + x1 * c1
        a20, a21, a30, a31 = a20 + x2 * c0, a21 + x2 * c1, a30 + x3 * c0, a31 + x3 * c1
    sums[0], sums[1], sums[4], sums[5] = a00, a01, a10, a11
    sums[8], sums[9], sums[12], sums[13] = a20, a21, a30, a31


#: Above this many (padded) columns the pass splits two rows once into slices it keeps,
#: then multiplies; up to it, it splits as it multiplies, once per block of columns.
#: Measured with one 260-row width class (bench/probe_cost.py's MLP and LM shapes): split
#: as it goes, d = 128 (k = 2) took 0.72x the time, d = 512 (k = 6) 0.88x, d = 1024
#: (k = 11, three blocks) 1.02x and d = 2048 (k = 21) 1.33x.
_SPLIT_ONCE = 8


def padded_columns(k: int) -> int:
    """The columns of a width class's stacked matrices for the compiled pass: ``k``
    rounded up to an even number (its blocks take four or two columns); the added
    columns are zeros."""
    return k + k % 2


def _changes(
    values: np.ndarray,
    earlier: np.ndarray,
    before: np.ndarray,
    known: np.ndarray,
    first: int,
    pair: int,
    out: np.ndarray,
) -> bool:  # pragma: no cover - compiled by Numba, inlined into the pass
    """``out[r] = values[first + r] - earlier[first + r]`` for the ``pair`` rows, in
    float32 (numpy's subtraction, bit for bit); returns whether those rows of ``before``
    and ``known`` (integer views of ``earlier`` and of the rows to compare it with) hold
    the same bits."""
    differ = np.uint32(0)
    for r in range(pair):
        row = first + r
        for i in range(out.shape[1]):
            out[r, i] = values[row, i] - earlier[row, i]
            differ |= before[row, i] ^ known[row, i]
    return bool(differ == 0)


def _project_pair(
    source: np.ndarray,
    at: int,
    pair: int,
    q: np.ndarray,
    width: int,
    work: tuple[np.ndarray, np.ndarray, np.ndarray],
    out: tuple[np.ndarray, np.ndarray],
    row: int,
) -> None:  # pragma: no cover - compiled by Numba, inlined into the pass
    """The probes of rows ``at`` and ``at + pair - 1`` of ``source`` (one row alone when
    ``pair`` is 1) by the matrix ``q``, into rows ``row`` and ``row + 1`` of ``out``
    (the probes, and their bits); ``work`` holds the pass's scratch: four rows of
    slices, the sums, the scales."""
    slices, sums, scales = work
    probes, bits = out
    k = probes.shape[1]
    columns = q.shape[0]
    unit = 2.0**width
    to = at + pair - 1
    scales[0] = _scale(source[at], width)
    scales[1] = _scale(source[to], width)
    # A bad row (scale 0) is split with any scale: its sums are never read, its probe is
    # the NaN.
    first = scales[0] if scales[0] > 0.0 else 1.0
    second = scales[1] if scales[1] > 0.0 else 1.0
    split = columns <= _SPLIT_ONCE
    if not split:
        _split_row(source[at], first, unit, slices[0], slices[1])
        _split_row(source[to], second, unit, slices[2], slices[3])
    j = 0
    while j < k:
        block = 4 if j + 4 <= columns else 2
        if split and block == 4:
            _dots_4x4(source, at, to, True, (first, second, unit), q, j, sums)
        elif split:
            _dots_4x2(source, at, to, True, (first, second, unit), q, j, sums)
        elif block == 4:
            _dots_4x4(slices, 0, 0, False, (first, second, unit), q, j, sums)
        else:
            _dots_4x2(slices, 0, 0, False, (first, second, unit), q, j, sums)
        for r in range(pair):
            scale = scales[r]
            for c in range(min(block, k - j)):
                if scale == 0.0:
                    bits[row + r, j + c] = 0x7FC00000
                    continue
                # exact_finish: the same two operations and one rounding.
                total = sums[8 * r + c] / scale
                total += sums[8 * r + 4 + c] / (scale * unit)
                probes[row + r, j + c] = (
                    np.float32(0.0) if abs(total) < 2.0**-126 else np.float32(total)
                )
        j += block


def _project_pass(
    values: np.ndarray,
    earlier: np.ndarray,
    last: np.ndarray,
    matrices: np.ndarray,
    parts: np.ndarray,
    width: int,
    out: np.ndarray,
) -> bool:  # pragma: no cover - compiled by Numba (its bits are tested against numpy's)
    """Exact probes of float32 rows ``values`` ``(r, d)`` into float32 ``out`` ``(r, k)``.

    ``parts[i] = (slot, start, stop)``: rows ``start:stop`` use ``matrices[slot]``, a
    probe matrix in float64, transposed and padded with zero columns
    (:func:`padded_columns`): ``(padded k, d)``.

    With ``n = len(earlier)`` rows of pre-update values, rows ``n`` to ``2n`` of
    ``values`` are not read: row ``n + i`` is the change ``values[i] - earlier[i]``,
    subtracted as the pass reaches it (:meth:`ProbeSet.project_steps`). Returns whether
    ``earlier`` holds the bits of ``last`` (never where their shapes differ), read as
    the pass goes: so the block of changes is never written and read back, nor the
    pre-update rows read a second time to compare them.
    """
    n, d = earlier.shape
    same = bool(last.shape[0] == n and last.shape[1] == d)
    # The bits to compare: the pre-update rows', and the last post-update rows' where
    # their shapes agree (else the pre-update rows' again, which the result ignores).
    before = earlier.view(np.uint32)
    known = last.view(np.uint32) if same else before
    # Scratch: the high and low slices of two rows, where the pass splits them
    # beforehand; the sums; the scales; two changes, where it subtracts them.
    work = (np.zeros((4, values.shape[1])), np.empty(16), np.empty(2))
    changes = np.zeros((2, values.shape[1]), np.float32)
    probes = (out, out.view(np.uint32))
    for part in range(parts.shape[0]):
        q = matrices[parts[part, 0]]
        stop = parts[part, 2]
        for row in range(parts[part, 1], stop, 2):
            # A part of odd length ends on one row, taken twice: its second sums are unused.
            pair = min(2, stop - row)
            if n <= row < 2 * n:
                same = _changes(values, earlier, before, known, row - n, pair, changes) and same
                _project_pair(changes, 0, pair, q, width, work, probes, row)
            else:
                _project_pair(values, row, pair, q, width, work, probes, row)
    return same
