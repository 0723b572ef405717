"""Probes (:mod:`zkdv.probes`) computed by XLA on the device that holds the parameters.

The probe's arithmetic is exact by construction (Ozaki splitting, see
:mod:`zkdv.probes`), so these kernels return the same float32 bits as
:meth:`zkdv.probes.ProbeSet.project` on the host, on any backend: a transcript is
byte-identical whichever side computed its probes. Only the probe values (a few KiB per
step) leave the device.

Float64 is required for the exact slice products, so the programs are traced and run
with ``jax.enable_x64(True)``; the training program itself is unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv.probes import CANONICAL_NAN, ProbeSet, slice_width

__all__ = ["DeviceProbes", "project"]

_TINY = 2.0**-126


def _rows(leaf: Any, rows: int, d: int, selected: np.ndarray | None) -> Any:
    values = jnp.reshape(leaf, (rows, d))
    if selected is not None:
        values = jnp.take(values, jnp.asarray(selected), axis=0)
    # Half-precision leaves are upcast exactly; wider ones are rounded to float32, as
    # ProbeSet.project does.
    return values.astype(jnp.float32)


def project(values: Any, matrix: Any) -> Any:
    """The exact probe of float32 rows ``(r, d)`` against a float64 exact matrix ``(d, k)``.

    The same steps as :func:`zkdv.probes.exact_rows` and :func:`zkdv.probes.exact_finish`;
    call under ``jax.enable_x64(True)``.
    """
    rows, d = values.shape
    width = slice_width(d)
    if rows == 0 or d == 0 or matrix.shape[1] == 0:
        return jnp.zeros((rows, matrix.shape[1]), jnp.float32)
    peak = jnp.max(jnp.abs(values), axis=1)
    bad = ~jnp.isfinite(peak)
    # Always flush subnormals (the host does where they can matter; elsewhere they
    # are below the slices' resolution): an XLA backend may flush them on its own.
    values = jnp.where(bad[:, None] | (jnp.abs(values) < jnp.float32(_TINY)), 0.0, values)
    peak = jnp.max(jnp.abs(values), axis=1)
    _, top = jnp.frexp(peak)
    scale = jnp.ldexp(jnp.float64(1.0), width - top.astype(jnp.int32))
    scaled = values.astype(jnp.float64) * scale[:, None]
    high = jnp.trunc(scaled)
    low = jnp.trunc((scaled - high) * jnp.float64(2.0**width))
    products = jnp.matmul(jnp.concatenate([high, low]), matrix, precision=lax.Precision.HIGHEST)
    # A barrier keeps the two halves of one exact GEMM apart: no rewrite may turn the
    # sum below into a GEMM accumulating onto the other half (not exact).
    products = lax.optimization_barrier(products)  # type: ignore[no-untyped-call]
    total = products[:rows] / scale[:, None] + products[rows:] / (
        scale[:, None] * jnp.float64(2.0**width)
    )
    total = jnp.where(jnp.abs(total) < _TINY, 0.0, total)
    out = lax.bitcast_convert_type(total.astype(jnp.float32), jnp.uint32)
    out = jnp.where(out == jnp.uint32(0x80000000), jnp.uint32(0), out)
    out = jnp.where(bad[:, None], jnp.uint32(int(CANONICAL_NAN)), out)
    return lax.bitcast_convert_type(out, jnp.float32)


def _probe_all(
    layout: tuple[tuple[int, int, int], ...],
    selections: tuple[np.ndarray | None, ...],
    leaves: Sequence[Any],
    matrices: Sequence[Any],
) -> Any:
    parts = []
    for (rows, d, _), selected, leaf, matrix in zip(
        layout, selections, leaves, matrices, strict=True
    ):
        parts.append(project(_rows(leaf, rows, d, selected), matrix).reshape(-1))
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


class DeviceProbes:
    """One run's probe matrices on a device and the compiled program that projects a tree.

    Args:
        probes: the run's :class:`~zkdv.probes.ProbeSet` (created by the core when the
            transcript opens).
        device: where the parameters live; the matrices are placed there once. None:
            JAX's default placement.
    """

    def __init__(self, probes: ProbeSet, device: Any = None) -> None:
        self.probes = probes
        self.layout = tuple(
            (rows, last, matrix.shape[1])
            for (rows, last), matrix in zip(probes.row_shapes, probes.matrices, strict=True)
        )
        self.sizes = [
            (rows if sel is None else len(sel)) * k
            for (rows, _, k), sel in zip(self.layout, probes.rows, strict=True)
        ]
        with jax.enable_x64(True):
            self.matrices = [
                jax.device_put(np.asarray(m, dtype=np.float64), device) for m in probes.matrices
            ]
            self._program = jax.jit(functools.partial(_probe_all, self.layout, tuple(probes.rows)))

    @property
    def floats(self) -> int:
        return sum(self.sizes)

    def __call__(self, leaves: Sequence[Any]) -> jax.Array:
        """Dispatch the probes of one parameter tree (post-update, delta or pre-update):
        one float32 vector, leaf after leaf, each ``(rows, k)`` in C order."""
        with jax.enable_x64(True):
            result: jax.Array = self._program(list(leaves), self.matrices)
        return result

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """The host copy of :meth:`__call__`'s result as one ``(rows, k)`` array per leaf."""
        out = []
        offset = 0
        for size, (rows, _, k), selected in zip(
            self.sizes, self.layout, self.probes.rows, strict=True
        ):
            n = rows if selected is None else len(selected)
            out.append(flat[offset : offset + size].reshape(n, k))
            offset += size
        return out
