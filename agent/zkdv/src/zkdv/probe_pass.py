"""The exact probe pass's parts, compiled one by one: an internal API for the benches.

``bench/probe_cost.py`` (and ``bench/_floor.py``, which reports its floor beside the
frontends' overheads) times the exact pass of :mod:`zkdv.probes` against what it cannot
go below: the float64 products alone, by BLAS as the numpy path runs them
(:func:`gemm`) or by the compiled pass's own dot products (:func:`products_kernel`),
and the split of each row into its two slices alone (:func:`split_kernel`). The
kernels here call the pass's own helpers (:mod:`zkdv._probe_pass`), compiled with the
pass's ``fastmath`` flags, so what is timed is what the pass runs; they live beside the
pass so that a change to its helpers is a change here too.

Each kernel is built by Numba on first use and is None where the pass itself is not
compiled (no Numba, or ``ZKDV_PROBES_JIT=0``: :data:`JIT_ENV`). Not cached on disk:
Numba would not see a change to the helpers, defined in another module.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from zkdv._numba import jit
from zkdv._probe_pass import (
    JIT_ENV,
    PASS_HELPERS,
    _dots_4x2,
    _dots_4x4,
    _kernel,
    _slices,
    padded_columns,
)
from zkdv.probes import _gemm

__all__ = [
    "JIT_ENV",
    "compiled_pass",
    "gemm",
    "padded_columns",
    "products_kernel",
    "split_kernel",
]

_products_state: dict[str, object] = {}
_split_state: dict[str, object] = {}


def compiled_pass() -> bool:
    """Whether :mod:`zkdv.probes` projects with the compiled pass in this process."""
    return _kernel() is not None


def gemm(a: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ q`` as the numpy path computes it: in row blocks that keep each
    product single-threaded."""
    _gemm(a, q, out)


def _products_pass(
    slices: np.ndarray, matrix: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled by Numba
    """The exact pass's dot products alone: ``slices`` holds each pair of rows' four
    slices (high, low, high, low), ``matrix`` is ``(padded k, d)``
    (:func:`padded_columns`); ``out[4 * p + s, c]`` is slice ``s`` of pair ``p`` times
    column ``c``."""
    k = out.shape[1]
    columns = matrix.shape[0]
    sums = np.empty(16)
    for pair in range(slices.shape[0] // 4):
        source = slices[4 * pair : 4 * pair + 4]
        j = 0
        while j < k:
            if j + 4 <= columns:
                _dots_4x4(source, 0, 0, False, (1.0, 1.0, 1.0), matrix, j, sums)
                block = 4
            else:
                _dots_4x2(source, 0, 0, False, (1.0, 1.0, 1.0), matrix, j, sums)
                block = 2
            for s in range(4):
                for c in range(min(block, k - j)):
                    out[4 * pair + s, j + c] = sums[4 * s + c]
            j += block


def _try_products(kernel: Callable[..., object]) -> None:
    kernel(np.ones((4, 2)), np.ones((padded_columns(1), 2)), np.empty((4, 1)))


def products_kernel() -> Callable[..., object] | None:
    """The compiled products alone, ``kernel(slices, matrix, out)``, or None where the
    exact pass is not compiled."""
    helpers = {name: PASS_HELPERS[name] for name in ("_slices", "_dots_4x4", "_dots_4x2")}
    kernel: Callable[..., object] | None = jit(
        _products_state, JIT_ENV, _products_pass, _try_products, helpers=helpers, cache=False
    )
    return kernel


def _split_pass(
    values: np.ndarray, width: int, slices: np.ndarray
) -> None:  # pragma: no cover - compiled by Numba
    """The exact pass's split alone, as tight as it goes: every float32 row of ``values``
    into two rows of ``slices`` that stay in L1, each element by the pass's own
    ``_slices``; the peak of a row from its bits, inline (no NaN or infinity here)."""
    unit = 2.0**width
    words = values.view(np.uint32)
    for row in range(values.shape[0]):
        peak = np.uint32(0)
        for i in range(values.shape[1]):
            peak = max(peak, words[row, i] & np.uint32(0x7FFFFFFF))
        exponent = int(peak >> np.uint32(23))
        scale = math.ldexp(1.0, width - (exponent - 126 if exponent > 0 else 0))
        for i in range(values.shape[1]):
            slices[0, i], slices[1, i] = _slices(values[row, i], scale, unit)


def _try_split(kernel: Callable[..., object]) -> None:
    kernel(np.ones((1, 2), np.float32), 26, np.empty((2, 2)))


def split_kernel() -> Callable[..., object] | None:
    """The compiled split alone, ``kernel(values, width, slices)``, or None where the
    exact pass is not compiled."""
    helpers = {"_slices": PASS_HELPERS["_slices"]}
    kernel: Callable[..., object] | None = jit(
        _split_state, JIT_ENV, _split_pass, _try_split, helpers=helpers, cache=False
    )
    return kernel
