"""Seeded orthonormal probes: small linear projections of every parameter leaf.

Per parameter leaf of last dimension ``d``, the probe matrix ``Q`` is a ``(d, k)``
matrix with orthonormal columns, ``k = max(1, ceil(probe_ratio * d))``, drawn from a
Gaussian seeded by the run's probe seed and the leaf's path and orthonormalised by QR.
The probe of a leaf ``W`` (viewed as ``(rows, d)``) is ``W @ Q``.

Leaves with more than ``MAX_PROBE_ROWS`` rows are probed on a seeded subset of that
many rows, so a probe costs microseconds and a few KiB per step however large the model
(each probed row still keeps ``probe_ratio`` of the last dimension). Probes are a
tolerance device for cross-hardware replay, not the binding commitment: every byte is
bound by the Merkle roots.

Probes are linear, so ``probe(pre) + probe(delta) == probe(post)`` and
``probe(post_t) == probe(pre_{t+1})`` hold up to float error. They let a replay on
different hardware be compared within a tolerance where exact hashes cannot match.

**The projection's arithmetic is exact by construction**, so the host (numpy), XLA and
Torch kernels that compute it agree to the bit on every backend, whatever order their
matrix products sum in (this is what makes a transcript byte-identical whether its
probes were computed on the host or on the device). It is the error-free splitting of
Ozaki et al. (2012, "Error-free transformations of matrix multiplication by using fast
routines of matrix multiplication"): with ``L = ceil(log2 d)`` and
``w = (53 - L) // 2``,

* the matrix ``Q`` is stored with each column truncated to ``w`` significant bits below
  its largest element's exponent (:func:`exact_matrix`; a change of at most
  ``2**(1 - w)`` of the column's largest entry, where ``w >= 16`` for any ``d`` below
  two million);
* each probed row ``v`` (float32, subnormals flushed to zero) is split into two slices
  of ``w`` bits below the row's largest exponent ``e`` (``|v| < 2**e``):
  ``n1 = trunc(v * 2**(w - e))`` and ``n2 = trunc(frac(v * 2**(w - e)) * 2**w)``, both
  integers below ``2**w`` (:func:`exact_rows`), so ``v ~ (n1 + n2 / 2**w) / 2**(w - e)``;
  what is below ``2w`` bits of the row's largest element (``2w >= 32``, more than
  float32's 24) is dropped, an error far below float32 rounding;
* every product of a slice element and a ``w``-bit matrix entry is an integer multiple
  of one power of two below ``2**(2w)``, so the ``d``-term sums ``n1 @ Q`` and
  ``n2 @ Q`` stay below ``2**53`` units and **every float64 GEMM computes them exactly**,
  in any order, blocked or not, with or without FMA;
* the probe is ``float32((n1 @ Q) / 2**(w-e) + (n2 @ Q) / 2**(2w-e))``: exact scalings,
  one float64 addition, one rounding (:func:`exact_finish`); results below float32's
  smallest normal are flushed to zero, zeros made positive, and a row holding an
  infinity or NaN gives the one quiet NaN.
"""

from __future__ import annotations

import importlib
import math
import os
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import LeafSpec

__all__ = [
    "MAX_PROBE_ROWS",
    "ProbeSet",
    "exact_finish",
    "exact_matrix",
    "exact_rows",
    "probe_columns",
    "slice_width",
]

MAX_PROBE_ROWS = 64


def probe_columns(last_dim: int, probe_ratio: float) -> int:
    if not 0.0 < probe_ratio <= 1.0:
        raise ValueError(f"probe_ratio={probe_ratio!r} must be in (0, 1]")
    return max(1, math.ceil(probe_ratio * last_dim))


def _leaf_dims(spec: LeafSpec) -> tuple[int, int]:
    if len(spec.shape) == 0:
        return 1, 1
    last = spec.shape[-1]
    return (spec.size // last if last else 0), last


# OpenBLAS runs a GEMM single-threaded below m * n * k = 65536 * 4 (its
# GEMM_MULTITHREAD_THRESHOLD); above, it wakes every BLAS thread. A probe is tiny, and
# while the training step and the hashing pool own the cores, waking them cost 15-25 ms
# per leaf on a 2-core machine (0.1 ms single-threaded). Row blocks under the threshold
# keep each product single-threaded on every BLAS.
_SINGLE_THREAD_GEMM = 65536 * 4 - 1

_FLOAT32_TINY = 2.0**-126
CANONICAL_NAN = np.uint32(0x7FC00000)

#: A leaf's share of a batch of probe rows: its float64 matrix and the rows
#: ``start:stop`` it projects.
Part = tuple[np.ndarray, int, int]


def slice_width(last_dim: int) -> int:
    """Bits per slice for rows of ``last_dim`` elements: ``(53 - ceil(log2 d)) // 2``."""
    return (53 - max(0, int(last_dim) - 1).bit_length()) // 2


def exact_matrix(matrix: np.ndarray) -> np.ndarray:
    """A probe matrix with every column truncated to :func:`slice_width` bits (float32).

    ``trunc(q * 2**s) / 2**s`` is exact in float64 for a power of two ``2**s``.
    """
    q = np.asarray(matrix, dtype=np.float32)
    q = np.where(np.abs(q) < np.float32(_FLOAT32_TINY), 0.0, q.astype(np.float64))
    _, top = np.frexp(np.abs(q).max(axis=0, initial=0.0))
    scale = np.ldexp(1.0, slice_width(q.shape[0]) - top)[None, :]
    truncated: np.ndarray = (np.trunc(q * scale) / scale).astype(np.float32)
    return truncated


def exact_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split float32 rows ``(r, d)`` into integer-valued slices.

    Returns:
        ``(slices, scale, bad)``: ``slices`` is ``[n1; n2]`` (float64 integers below
        ``2**w``, ``(2r, d)``) with ``v ~ n1 / scale + n2 / (scale * 2**w)``; ``scale``
        the per-row power of two; ``bad`` the rows holding an infinity or NaN (their
        probe is NaN).
    """
    rows, d = values.shape
    width = slice_width(d)
    with np.errstate(invalid="ignore"):
        peak = np.abs(values).max(axis=1, initial=0).astype(np.float64)
    bad = ~np.isfinite(peak)
    if bad.any():
        values = np.where(bad[:, None], np.float32(0), values)
        peak = np.where(bad, 0.0, peak)
    # Subnormal inputs reach the slices only in nonzero rows whose largest element is
    # below 2**(2w - 127); a device flushing subnormals sees zeros there, so flush them
    # too (in every row: elsewhere they give zero slices anyway).
    small = (peak > 0) & (peak < 2.0 ** (2 * width - 127))
    flushed = bool(small.any())
    if flushed:
        values = np.where(np.abs(values) < np.float32(_FLOAT32_TINY), np.float32(0), values)
        peak = np.abs(values).max(axis=1, initial=0).astype(np.float64)
    _, top = np.frexp(peak)
    scale = np.ldexp(1.0, width - top)
    out = np.empty((2 * rows, d), dtype=np.float64)
    high, low = out[:rows], out[rows:]
    if not flushed:
        # In float32, half the bytes of float64: every step is exact there too. Scaling
        # by a power of two (at most 2**(126 - w) here) is exact unless the result is
        # below float32's smallest normal, and such an element gives two zero slices
        # either way; the fraction and its scaling keep bits the value already has.
        scaled = values * scale.astype(np.float32)[:, None]
        whole = np.trunc(scaled)
        scaled -= whole
        scaled *= np.float32(2.0**width)
        np.trunc(scaled, out=scaled)
        high[...] = whole
        low[...] = scaled
        return out, scale, bad
    # Widen first: a float32 * float64 ufunc casts in small buffers, several times slower.
    low[...] = values
    low *= scale[:, None]  # v * scale, exactly (a power of two), below 2**w
    np.trunc(low, out=high)
    low -= high  # the fraction, exactly
    low *= 2.0**width
    np.trunc(low, out=low)
    return out, scale, bad


def exact_finish(
    products: np.ndarray, scale: np.ndarray, width: int, bad: np.ndarray
) -> np.ndarray:
    """``float32(P1 / s + P2 / (s * 2**w))`` of the exact slice products, canonicalised.

    Dividing by a power of two is exact, so this is one float64 addition and one
    rounding to float32; results below float32's smallest normal become zero, zeros are
    positive and bad rows the quiet NaN ``0x7FC00000``.
    """
    rows = len(products) // 2
    total = products[:rows] / scale[:, None]
    total += products[rows:] / (scale[:, None] * 2.0**width)
    # Results below the smallest normal, zeros of either sign among them, become +0;
    # every other total rounds to a nonzero normal float32 (or overflows to infinity).
    tiny = np.abs(total) < _FLOAT32_TINY
    with np.errstate(over="ignore"):
        out: np.ndarray = total.astype(np.float32)
    out[tiny] = 0
    if bad.any():
        out.view(np.uint32)[bad] = CANONICAL_NAN
    return out


def _project_groups(values: np.ndarray, parts: Sequence[Part]) -> np.ndarray:
    """Exact probes of float32 rows ``values``: rows ``start:stop`` against matrix ``q``.

    Every row is split and rounded on its own and each product is exact in any order,
    so this gives the bits of one call per part. One split and one finish
    for many leaves keep the number of numpy calls low: on a small model their fixed
    cost, not the arithmetic, is most of the time (and each call is a point where the
    training thread may take the interpreter lock back).
    """
    split, scale, bad = exact_rows(values)
    rows = len(values)
    products = np.empty((2 * rows, parts[0][0].shape[1] if parts else 0), dtype=np.float64)
    for q, start, stop in parts:
        _gemm(split[start:stop], q, products[start:stop])
        _gemm(split[rows + start : rows + stop], q, products[rows + start : rows + stop])
    return exact_finish(products, scale, slice_width(values.shape[1]), bad)


# --- One compiled pass per width class (Numba) ---------------------------------------------
# The same arithmetic as exact_rows, the products and exact_finish, two rows at a time in
# one compiled loop: every slice is the same integer, every product sum is exact in any
# order (the module docstring), and the finish is the same two float64 operations and
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
_kernel_state: dict[str, Any] = {}

#: What the dot products may reorder: their sums are exact in any order and their products
#: exact, so summing in vector lanes (``reassoc``) and fused multiply-adds (``contract``)
#: keep the bits; nothing else is relaxed (no reciprocal, no assumption about NaN or zeros).
EXACT_SUM_FASTMATH = frozenset({"reassoc", "contract"})

#: The pass's helpers and the ``fastmath`` flags each is compiled with: only the dot
#: products are relaxed; the split and the finish, whose roundings matter, are strict.
PASS_HELPERS: Mapping[str, frozenset[str]] = {
    "_scale": frozenset(),
    "_slices": frozenset(),
    "_split_row": frozenset(),
    "_dots_4x4": EXACT_SUM_FASTMATH,
    "_dots_4x2": EXACT_SUM_FASTMATH,
}


def _kernel() -> Any:
    """The compiled pass, or None without Numba (or with ``ZKDV_PROBES_JIT=0``)."""
    return jit(_kernel_state, JIT_ENV, _project_pass, _try_pass, helpers=PASS_HELPERS)


def _try_pass(kernel: Any) -> None:
    out = np.empty((2, 1), dtype=np.float32)
    matrix = np.ones((1, padded_columns(1), 2), dtype=np.float64)
    earlier = np.zeros((1, 2), np.float32)
    kernel(np.ones((2, 2), np.float32), earlier, earlier, matrix, np.array([[0, 0, 2]]), 26, out)


_jit_lock = threading.Lock()


def jit(
    state: dict[str, Any],
    env: str,
    function: Any,
    trial: Callable[[Any], None],
    helpers: Mapping[str, frozenset[str]] | None = None,
    cache: bool = True,
) -> Any:
    """``function`` compiled by Numba (``nogil``) on first use and kept in ``state``, or
    None: with ``env`` set to ``0``, without Numba, or when it cannot build or run it on
    the tiny input ``trial`` gives, so the caller takes its numpy or Torch path. The
    machine code is cached on disk where Numba finds a writable place (beside the
    module, else the user's cache): a process then loads it in milliseconds instead of
    compiling it for a second or two, which it did on the commit thread while the first
    training steps ran beside it.

    ``helpers`` names module-level functions ``function`` calls, each compiled with its
    own ``fastmath`` flags (Numba applies them to a whole function): the flags stay on
    the few lines whose arithmetic they cannot change. Numba's cache of a function is
    renewed when its own file changes, not when a helper's does: a ``function`` defined
    in another module than its helpers is built with ``cache=False``."""
    if os.environ.get(env, "1") == "0":
        return None
    with _jit_lock:
        if "kernel" not in state:
            state["kernel"] = _build(function, trial, helpers or {}, cache)
    return state["kernel"]


def _build(
    function: Any,
    trial: Callable[[Any], None],
    helpers: Mapping[str, frozenset[str]],
    cache: bool,
) -> Any:
    try:
        numba = importlib.import_module("numba")

        def njit(py: Any, **options: Any) -> Any:
            try:
                return numba.njit(nogil=True, cache=cache, error_model="numpy", **options)(py)
            except RuntimeError:  # no writable cache location: compile in every process
                return numba.njit(nogil=True, cache=False, error_model="numpy", **options)(py)

        if helpers:
            # The function and its helpers see the helpers compiled: copies of them over
            # globals in which their names are bound to the compiled helpers (the modules
            # keep the Python ones), with the names of the helpers' own modules too.
            # Numba compiles on first call, once all are bound.
            names = dict(function.__globals__)
            for name in helpers:
                if name in function.__globals__:
                    for key, value in function.__globals__[name].__globals__.items():
                        names.setdefault(key, value)

            def over_names(py: Any) -> Any:
                return types.FunctionType(py.__code__, names, py.__name__, py.__defaults__)

            for name, fastmath in helpers.items():
                names[name] = njit(over_names(names[name]), fastmath=set(fastmath))
            function = over_names(function)
        kernel = njit(function)
        trial(kernel)
    except Exception:  # noqa: BLE001 - any failure to build means: the uncompiled path
        return None
    return kernel


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
    k = out.shape[1]
    columns = matrices.shape[1]
    n, d = earlier.shape
    unit = 2.0**width
    tiny = 2.0**-126
    same = bool(last.shape[0] == n and last.shape[1] == earlier.shape[1])
    # The bits to compare: the pre-update rows', and the last post-update rows' where
    # their shapes agree (else the pre-update rows' again, which the result ignores).
    before = earlier.view(np.uint32)
    known = last.view(np.uint32) if same else before
    # The high and low slices of two rows, where the pass splits them beforehand; two
    # changes, where it subtracts them.
    slices = np.zeros((4, values.shape[1]), np.float64)
    changes = np.zeros((2, values.shape[1]), np.float32)
    sums = np.empty(16, np.float64)
    scales = np.empty(2, np.float64)
    bits = out.view(np.uint32)
    for part in range(parts.shape[0]):
        q = matrices[parts[part, 0]]
        stop = parts[part, 2]
        for row in range(parts[part, 1], stop, 2):
            # A part of odd length ends on one row, taken twice: its second sums are unused.
            pair = min(2, stop - row)
            source, at, to = values, row, row + pair - 1
            if n <= row < 2 * n:
                # The changes, in float32 (numpy's subtraction, bit for bit), and the
                # comparison (here, not in a helper: a call costs each array passed a
                # reference count, which a row of 128 floats notices).
                differ = np.uint32(0)
                for r in range(pair):
                    i = row + r - n
                    for e in range(d):
                        changes[r, e] = values[i, e] - earlier[i, e]
                        differ |= before[i, e] ^ known[i, e]
                same = same and differ == 0
                source, at, to = changes, 0, pair - 1
            scales[0] = _scale(source[at], width)
            scales[1] = _scale(source[to], width)
            # A bad row (scale 0) is split with any scale: its sums are never read, its
            # probe is the NaN.
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
                        out[row + r, j + c] = (
                            np.float32(0.0) if abs(total) < tiny else np.float32(total)
                        )
                j += block
    return same


def _gemm(a: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ q`` in row blocks that keep each product single-threaded."""
    step = max(1, _SINGLE_THREAD_GEMM // max(1, q.shape[0] * q.shape[1]))
    if len(a) <= step:
        np.matmul(a, q, out=out)
        return
    for start in range(0, len(a), step):
        np.matmul(a[start : start + step], q, out=out[start : start + step])


class _Parts(NamedTuple):
    """The leaves of a block of rows: ``(leaf, start, stop)``, and the same with each
    leaf's slot in its width class's stacked matrices (for the compiled pass)."""

    spans: tuple[tuple[int, int, int], ...]
    slots: np.ndarray | None


@dataclass(frozen=True, eq=False)
class _Group:
    """One width class's block of probe rows in a :meth:`ProbeSet._layout`."""

    d: int
    rows: int
    #: Rows of the first arrays of its jobs (:meth:`ProbeSet.project_steps`' after rows).
    kind_rows: int
    #: ``(job, array position, start, stop)`` in job order.
    arrays: tuple[tuple[int, int, int, int], ...]
    parts: _Parts
    #: The parts of the first arrays only, at the same offsets.
    first: _Parts
    #: Per array position, ``(job, start, stop)`` in row order: in a ``by_kind`` layout
    #: each position's rows are one block, filled by one copy.
    kinds: tuple[tuple[tuple[int, int, int], ...], ...]


#: Layouts a ProbeSet keeps (a run has one or two; a caller of many shapes, more).
_LAYOUTS_KEPT = 64


@dataclass
class ProbeSet:
    """The probe matrices of one run, one per parameter leaf (computed once, reused)."""

    specs: tuple[LeafSpec, ...]
    probe_ratio: float
    seed: bytes
    matrices: tuple[np.ndarray, ...]
    rows: tuple[np.ndarray | None, ...]
    #: The matrices in float64 (:meth:`_matrix64`).
    _wide: dict[int, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per last dimension, the stacked float64 matrices (:meth:`_stacked`).
    _by_width: dict[int, tuple[np.ndarray, dict[int, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per leaf, ``(rows, last dimension)``: the matrix a probe reads the leaf as.
    row_shapes: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    #: Where :meth:`project_many` and :meth:`project_steps` put each array (:meth:`_layout`).
    _layouts: dict[Any, tuple[_Group, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per width class, the two blocks of rows :meth:`project_steps` fills in turn.
    _blocks: dict[int, list[np.ndarray]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per width class, the layout of the last :meth:`project_steps`, its post-update rows
    #: and their probes: the next step's pre-update rows are usually these bits.
    _last_post: dict[int, tuple[_Group, np.ndarray, dict[int, np.ndarray]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Worked out once: a step selects the rows of every leaf, two or three times.
        self.row_shapes = tuple(_leaf_dims(spec) for spec in self.specs)

    @classmethod
    def create(cls, specs: Sequence[LeafSpec], probe_ratio: float, seed: bytes) -> ProbeSet:
        matrices = []
        selections: list[np.ndarray | None] = []
        for spec in specs:
            n_rows, d = _leaf_dims(spec)
            k = probe_columns(max(d, 1), probe_ratio)
            digest = hash_bytes(Domain.PROBE, seed, spec.header(), length=32)
            rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
            if n_rows > MAX_PROBE_ROWS:
                selections.append(np.sort(rng.choice(n_rows, MAX_PROBE_ROWS, replace=False)))
            else:
                selections.append(None)
            if d == 0:
                matrices.append(np.zeros((0, k), dtype=np.float32))
                continue
            gaussian = rng.standard_normal((d, min(k, d)))
            q, r = np.linalg.qr(gaussian)
            # Fix QR's sign ambiguity so the matrix is a function of the seed alone.
            q *= np.sign(np.diag(r))
            matrices.append(np.ascontiguousarray(exact_matrix(q.astype(np.float32))))
        return cls(
            tuple(specs), float(probe_ratio), bytes(seed), tuple(matrices), tuple(selections)
        )

    def select(self, leaf: int, array: np.ndarray) -> np.ndarray:
        """The float32 rows of a leaf that its probe reads; reduced precision is upcast
        (exactly), wider dtypes are rounded to float32."""
        values = np.asarray(array).reshape(self.row_shapes[leaf])
        selected = self.rows[leaf]
        if selected is not None:
            values = values[selected]
        return values.astype(np.float32, copy=False)

    def project(self, leaf: int, array: np.ndarray) -> np.ndarray:
        """The probe of one leaf as float32 ``(rows, k)``."""
        return self.project_rows(leaf, self.select(leaf, array))

    def project_rows(self, leaf: int, rows: np.ndarray) -> np.ndarray:
        """The probe of already selected float32 rows of ``leaf`` (``(rows, d)``).

        For a frontend that keeps only the probed rows of a pre-update state (and
        projects ``post_rows - pre_rows`` as the delta): the same arithmetic as
        :meth:`project`.
        """
        return self.project_many([(leaf, [np.asarray(rows, dtype=np.float32)])])[0][0]

    def project_many(
        self, jobs: Sequence[tuple[int, Sequence[np.ndarray]]]
    ) -> list[list[np.ndarray]]:
        """:meth:`project_rows` of float32 row arrays of many leaves: ``[(leaf, arrays)]``.

        The bits of one call per array; the arrays of all leaves with the same last
        dimension (hence the same number of probe columns) are split, multiplied and
        finished together, in one compiled pass where Numba is installed. The layout of
        a list of jobs is worked out once (:meth:`_layout`): training projects the same
        shapes every step, and on a model of many small leaves the per-leaf Python, not
        the arithmetic, was most of the time.
        """
        layout = self._layout(tuple((leaf, tuple(len(a) for a in arrays)) for leaf, arrays in jobs))
        results: list[list[np.ndarray]] = [[] for _ in jobs]
        for group in layout:
            values = _scratch("values", (group.rows, group.d), np.float32)
            for index, position, start, stop in group.arrays:
                values[start:stop] = jobs[index][1][position]
            probes, _ = self._project(group, group.parts, values, _kernel())
            for index, _, start, stop in group.arrays:
                results[index].append(probes[start:stop])
        return results

    def project_steps(
        self,
        before: Sequence[np.ndarray],
        after: Sequence[np.ndarray],
        grads: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[np.ndarray], ...]:
        """Pre-update, post-update and delta probes from every leaf's selected float32 rows.

        The bits of :meth:`project_rows` of ``before``, ``after`` and ``after - before``
        for each leaf, and with ``grads`` (each leaf's selected gradient rows, None for
        a parameter without a gradient: its probe is zeros) the gradient's probes too.
        The pre-update probes of a width class are the previous call's post-update
        probes when ``before`` holds, bit for bit, the rows they came from (the usual
        case: nothing changes the parameters between two steps), so most steps project
        two arrays per leaf, not three; the deltas of a width class are one subtraction.

        Returns:
            ``(pre, post, delta)``, or ``(pre, post, delta, grad)`` with ``grads``.
        """
        # One job per leaf: (after, change[, grad]) rows, laid out in each width class as
        # [after of every leaf | change of every leaf | gradients], so that the changes
        # are one subtraction and the after rows one block the next step compares with.
        jobs = tuple(
            (leaf, (len(rows),) * (2 if grads is None or grads[leaf] is None else 3))
            for leaf, rows in enumerate(after)
        )
        layout = self._layout(jobs, by_kind=True)
        count = len(after)
        pre: list[np.ndarray] = [None] * count  # type: ignore[list-item]
        post, delta, grad = list(pre), list(pre), list(pre)
        kernel = _kernel()
        for group in layout:
            values = self._next_block(group)
            kind = group.kind_rows
            earlier = _scratch("earlier", (kind, group.d), np.float32)
            # Each kind's rows are one block, filled by one call rather than one per leaf.
            afters = group.kinds[0]
            np.concatenate([after[index] for index, _, _ in afters], out=values[:kind])
            np.concatenate([before[index] for index, _, _ in afters], out=earlier)
            if len(group.kinds) > 2:
                assert grads is not None
                gradients = [grads[index] for index, _, _ in group.kinds[2]]
                np.concatenate(gradients, out=values[2 * kind :])  # type: ignore[arg-type]
            last = self._last_post.get(group.d)
            held = last[1] if last is not None and last[0] is group else None
            # The changes (rows kind:2 * kind) and the comparison with the last post-update
            # rows are worked out in the same pass as the probes.
            probes, same = self._project(group, group.parts, values, kernel, earlier, held)
            for results, entries in zip((post, delta, grad), group.kinds, strict=False):
                for index, start, stop in entries:
                    results[index] = probes[start:stop]
            if same:
                assert last is not None
                for index, rows in last[2].items():
                    pre[index] = rows
            else:
                known, _ = self._project(group, group.first, earlier, kernel)
                for index, start, stop in afters:
                    pre[index] = known[start:stop]
            # The after rows' block, not a view of a tensor the next update overwrites.
            self._last_post[group.d] = (
                group,
                values[:kind],
                {index: post[index] for index, _, _ in afters},
            )
        if grads is None:
            return pre, post, delta
        # A parameter without a gradient has a zero gradient probe (zkdv.probes).
        grad = [np.zeros_like(p) if g is None else g for p, g in zip(post, grad, strict=True)]
        return pre, post, delta, grad

    def _next_block(self, group: _Group) -> np.ndarray:
        """The block :meth:`project_steps` fills for ``group``: one of two kept per width
        class, the other holding the last call's after rows. Kept rather than allocated:
        a fresh block of a megabyte costs its page faults on every step."""
        blocks = self._blocks.get(group.d)
        shape = (group.rows, group.d)
        if blocks is None or blocks[0].shape != shape:
            blocks = self._blocks[group.d] = [np.empty(shape, np.float32) for _ in range(2)]
        blocks.reverse()
        return blocks[0]

    def _layout(
        self, jobs: tuple[tuple[int, tuple[int, ...]], ...], by_kind: bool = False
    ) -> tuple[_Group, ...]:
        """Where each job's arrays go in its width class's block of rows (cached).

        ``jobs`` is ``((leaf, row counts of its arrays), ...)``. By default a job's
        arrays are consecutive; ``by_kind`` puts every job's first arrays first, then
        every second, then every third (:meth:`project_steps`).
        """
        key = (jobs, by_kind)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        members: dict[int, list[int]] = {}
        for index, (leaf, _) in enumerate(jobs):
            members.setdefault(int(self.matrices[leaf].shape[0]), []).append(index)
        groups = []
        for d, indices in members.items():
            placed: list[tuple[int, int, int, int]] = []
            if by_kind:
                start = 0
                for position in range(max(len(jobs[i][1]) for i in indices)):
                    for index in indices:
                        if position < len(jobs[index][1]):
                            stop = start + jobs[index][1][position]
                            placed.append((index, position, start, stop))
                            start = stop
                placed.sort(key=lambda entry: (entry[0], entry[1]))
            else:
                start = 0
                for index in indices:
                    for position, rows in enumerate(jobs[index][1]):
                        placed.append((index, position, start, start + rows))
                        start += rows
            groups.append(self._group(d, jobs, placed))
        layout = tuple(groups)
        if len(self._layouts) >= _LAYOUTS_KEPT:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _group(
        self,
        d: int,
        jobs: tuple[tuple[int, tuple[int, ...]], ...],
        placed: list[tuple[int, int, int, int]],
    ) -> _Group:
        def parts(entries: Sequence[tuple[int, int, int, int]]) -> _Parts:
            spans = tuple((jobs[index][0], start, stop) for index, _, start, stop in entries)
            if d == 0:
                return _Parts(spans, None)
            _, slot = self._stacked(d)
            return _Parts(spans, np.array([(slot[leaf], a, b) for leaf, a, b in spans], np.int64))

        firsts = [entry for entry in placed if entry[1] == 0]
        positions = 1 + max((entry[1] for entry in placed), default=-1)
        return _Group(
            d=d,
            rows=max((entry[3] for entry in placed), default=0),
            kind_rows=sum(entry[3] - entry[2] for entry in firsts),
            arrays=tuple(placed),
            parts=parts(placed),
            first=parts(firsts),
            kinds=tuple(
                tuple(
                    (index, start, stop)
                    for index, _, start, stop in sorted(
                        (entry for entry in placed if entry[1] == position),
                        key=lambda entry: entry[2],
                    )
                )
                for position in range(positions)
            ),
        )

    def _project(
        self,
        group: _Group,
        parts: _Parts,
        values: np.ndarray,
        kernel: Any,
        earlier: np.ndarray | None = None,
        last: np.ndarray | None = None,
    ) -> tuple[np.ndarray, bool]:
        """The exact probes of ``values``, rows ``start:stop`` by each part's leaf, by
        the compiled pass ``kernel`` (:func:`_kernel`) or, where it is None, numpy.

        With ``earlier``, :meth:`project_steps`' pre-update rows, the ``n`` rows after
        the first ``n`` of ``values`` are their changes (``values[i] - earlier[i]``),
        which this works out itself; it returns too whether ``earlier`` holds the bits
        of ``last``, the last step's post-update rows (False without them).
        """
        none = np.empty((0, group.d), np.float32)
        if parts.slots is not None and kernel is not None:
            stacked, _ = self._stacked(group.d)
            k = probe_columns(group.d, self.probe_ratio)
            probes = np.empty((len(values), k), dtype=np.float32)
            before = none if earlier is None else earlier
            same = kernel(
                values,
                before,
                none if last is None else last,
                stacked,
                parts.slots,
                slice_width(group.d),
                probes,
            )
            return probes, bool(same) and earlier is not None and last is not None
        if earlier is not None:
            kind = len(earlier)
            np.subtract(values[:kind], earlier, out=values[kind : 2 * kind])
        matrices = [(self._matrix64(leaf), a, b) for leaf, a, b in parts.spans]
        same = earlier is not None and last is not None and _same_bits(last, earlier)
        return _project_groups(values, matrices), same

    def project_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [self.project(i, array) for i, array in enumerate(arrays)]

    def _stacked(self, d: int) -> tuple[np.ndarray, dict[int, int]]:
        """The float64 matrices of every leaf of last dimension ``d``, transposed,
        padded with zero columns (:func:`padded_columns`) and stacked ``(n, padded k, d)``
        for the compiled pass, and each such leaf's slot in the stack (built on first
        use)."""
        held = self._by_width.get(d)
        if held is None:
            leaves = [leaf for leaf, m in enumerate(self.matrices) if m.shape[0] == d]
            k = self.matrices[leaves[0]].shape[1]
            stacked = np.zeros((len(leaves), padded_columns(k), d))
            for n, leaf in enumerate(leaves):
                stacked[n, :k] = self._matrix64(leaf).T
            held = self._by_width[d] = (stacked, {leaf: n for n, leaf in enumerate(leaves)})
        return held

    def _matrix64(self, leaf: int) -> np.ndarray:
        """A leaf's matrix in float64, as the exact products take it (built on first use)."""
        wide = self._wide.get(leaf)
        if wide is None:
            wide = self._wide[leaf] = self.matrices[leaf].astype(np.float64)
        return wide

    @property
    def floats(self) -> int:
        """Number of float32 values in one probe of the whole state."""
        return sum(
            min(rows, MAX_PROBE_ROWS) * m.shape[1]
            for (rows, _), m in zip(self.row_shapes, self.matrices, strict=True)
        )


_scratches = threading.local()


def _scratch(name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
    """A block this thread reuses for ``name`` (a fresh large one faults in its pages on
    every call); grown when a larger one is asked for."""
    kept: dict[str, np.ndarray] = _scratches.__dict__.setdefault("blocks", {})
    block = kept.get(name)
    size = shape[0] * shape[1]
    if block is None or block.size < size or block.dtype != dtype:
        block = kept[name] = np.empty(max(size, 1), dtype)
    return block[:size].reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 blocks hold the same bits (NaN payloads, signed zeros)."""
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
