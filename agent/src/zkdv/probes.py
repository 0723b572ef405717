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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import LeafSpec

__all__ = ["MAX_PROBE_ROWS", "ProbeSet", "probe_columns"]

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


def _project(values: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    rows = max(1, _SINGLE_THREAD_GEMM // max(1, matrix.shape[0] * matrix.shape[1]))
    if len(values) <= rows:
        return np.asarray(values @ matrix, dtype=np.float32)
    out = np.empty((len(values), matrix.shape[1]), dtype=np.float32)
    for start in range(0, len(values), rows):
        np.matmul(values[start : start + rows], matrix, out=out[start : start + rows])
    return out


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
            matrices.append(np.ascontiguousarray(q.astype(np.float32)))
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
        # Half-precision leaves are upcast so the projection itself adds no rounding
        # beyond float32's.
        return _project(values.astype(np.float32, copy=False), self.matrices[leaf])

    def project_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [self.project(i, array) for i, array in enumerate(arrays)]

    @property
    def floats(self) -> int:
        """Number of float32 values in one probe of the whole state."""
        return sum(
            min(_leaf_dims(s)[0], MAX_PROBE_ROWS) * m.shape[1]
            for s, m in zip(self.specs, self.matrices, strict=True)
        )
