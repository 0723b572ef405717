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

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    # Subnormal inputs reach the slices only in rows whose largest element is below
    # 2**(2w - 127); a device flushing subnormals sees zeros there, so flush them too.
    if len(peak) and peak.min() < 2.0 ** (2 * width - 127):
        values = np.where(np.abs(values) < np.float32(_FLOAT32_TINY), np.float32(0), values)
        peak = np.abs(values).max(axis=1, initial=0).astype(np.float64)
    _, top = np.frexp(peak)
    scale = np.ldexp(1.0, width - top)
    out = np.empty((2 * rows, d), dtype=np.float64)
    high, low = out[:rows], out[rows:]
    np.multiply(values, scale[:, None], out=low)  # v * scale, below 2**w
    np.trunc(low, out=high)
    np.subtract(low, high, out=low)  # the fraction, exactly
    np.multiply(low, 2.0**width, out=low)
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
    high = products[:rows] / scale[:, None]
    low = products[rows:] / (scale[:, None] * 2.0**width)
    total = high + low
    total = np.where(np.abs(total) < _FLOAT32_TINY, 0.0, total)
    with np.errstate(over="ignore"):
        out = total.astype(np.float32)
    bits = np.where(out == 0, np.uint32(0), out.view(np.uint32))
    return np.where(bad[:, None], CANONICAL_NAN, bits).astype(np.uint32).view(np.float32)


def _project(values: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """The exact probe of float32 rows ``values`` against an :func:`exact_matrix`."""
    split, scale, bad = exact_rows(values)
    q = matrix.astype(np.float64)
    rows = max(1, _SINGLE_THREAD_GEMM // max(1, q.shape[0] * q.shape[1]))
    products = np.empty((len(split), q.shape[1]), dtype=np.float64)
    for start in range(0, len(split), rows):
        np.matmul(split[start : start + rows], q, out=products[start : start + rows])
    return exact_finish(products, scale, slice_width(values.shape[1]), bad)


@dataclass
class ProbeSet:
    """The probe matrices of one run, one per parameter leaf (computed once, reused)."""

    specs: tuple[LeafSpec, ...]
    probe_ratio: float
    seed: bytes
    matrices: tuple[np.ndarray, ...]
    rows: tuple[np.ndarray | None, ...]

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

    def project(self, leaf: int, array: np.ndarray) -> np.ndarray:
        """The probe of one leaf as float32 ``(rows, k)``; reduced precision is upcast first."""
        rows, d = _leaf_dims(self.specs[leaf])
        values = np.asarray(array).reshape(rows, d)
        selected = self.rows[leaf]
        if selected is not None:
            values = values[selected]
        # Half-precision leaves are upcast (exactly); wider ones are rounded to float32.
        return _project(values.astype(np.float32, copy=False), self.matrices[leaf])

    def project_rows(self, leaf: int, rows: np.ndarray) -> np.ndarray:
        """The probe of already selected float32 rows of ``leaf`` (``(rows, d)``).

        For a frontend that keeps only the probed rows of a pre-update state (and
        projects ``post_rows - pre_rows`` as the delta): the same arithmetic as
        :meth:`project`.
        """
        return _project(np.asarray(rows, dtype=np.float32), self.matrices[leaf])

    def project_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [self.project(i, array) for i, array in enumerate(arrays)]

    @property
    def floats(self) -> int:
        """Number of float32 values in one probe of the whole state."""
        return sum(
            min(_leaf_dims(s)[0], MAX_PROBE_ROWS) * m.shape[1]
            for s, m in zip(self.specs, self.matrices, strict=True)
        )
