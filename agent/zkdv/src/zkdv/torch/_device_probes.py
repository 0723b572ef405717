"""Probes (:mod:`zkdv.probes`) computed by Torch on the device that holds the parameters.

The probe arithmetic is exact by construction (see :mod:`zkdv.probes`), so
:class:`DeviceProbes` returns the float32 bits :meth:`zkdv.probes.ProbeSet.project`
gives on the host, on CPU and CUDA alike; only the probe values leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zkdv.probes import CANONICAL_NAN, ProbeSet, slice_width

__all__ = ["DeviceProbes", "project"]

_TINY = 2.0**-126


def project(values: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """The exact probe of float32 rows ``(r, d)`` against a float64 exact matrix ``(d, k)``.

    The steps of :func:`zkdv.probes.exact_rows` and :func:`zkdv.probes.exact_finish`.
    """
    rows, d = values.shape
    k = matrix.shape[1]
    if rows == 0 or d == 0 or k == 0:
        return torch.zeros((rows, k), dtype=torch.float32, device=values.device)
    width = slice_width(d)
    bad = ~torch.isfinite(values.abs().amax(dim=1))
    values = torch.where(bad[:, None] | (values.abs() < _TINY), 0.0, values)
    _, top = torch.frexp(values.abs().amax(dim=1))
    scale = torch.ldexp(torch.ones_like(top, dtype=torch.float64), (width - top).to(torch.float64))
    scaled = values.to(torch.float64) * scale[:, None]
    high = torch.trunc(scaled)
    low = torch.trunc((scaled - high) * 2.0**width)
    products = torch.cat([high, low]) @ matrix
    total = products[:rows] / scale[:, None] + products[rows:] / (scale[:, None] * 2.0**width)
    total = torch.where(total.abs() < _TINY, 0.0, total)
    out = total.to(torch.float32)
    bits = torch.where(out == 0, 0, out.view(torch.int32))
    bits = torch.where(bad[:, None], int(CANONICAL_NAN), bits)
    return bits.view(torch.float32)


class DeviceProbes:
    """One run's probe matrices on a device, projecting a parameter tree there.

    Args:
        probes: the run's :class:`~zkdv.probes.ProbeSet`.
        device: where the parameters live; the matrices are copied there once.
    """

    def __init__(self, probes: ProbeSet, device: torch.device | str) -> None:
        self.probes = probes
        self.device = torch.device(device)
        self.matrices = [
            torch.from_numpy(np.asarray(m, dtype=np.float64)).to(self.device)
            for m in probes.matrices
        ]
        self.rows = [
            None if sel is None else torch.from_numpy(sel.astype(np.int64)).to(self.device)
            for sel in probes.rows
        ]
        self.shapes = []
        for shape, matrix, sel in zip(probes.row_shapes, probes.matrices, probes.rows, strict=True):
            count = shape[0]
            self.shapes.append((shape, (count if sel is None else len(sel), matrix.shape[1])))

    @property
    def floats(self) -> int:
        return sum(r * k for _, (r, k) in self.shapes)

    def select(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The rows each leaf's probe reads, as float32 copies (at most 64 rows a leaf).

        Take them before an in-place optimizer step to keep the pre-update rows.
        """
        out = []
        with torch.no_grad():
            for tensor, ((count, last), _), selected in zip(
                tensors, self.shapes, self.rows, strict=True
            ):
                values = tensor.detach().reshape(count, last)
                if selected is not None:
                    values = values.index_select(0, selected)
                out.append(values.to(torch.float32, copy=True))
        return out

    def select_present(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """:meth:`select`, with zero rows for an absent leaf (a parameter without a gradient)."""
        out = []
        for leaf, tensor in enumerate(tensors):
            if tensor is None:
                (_, last), (rows, _) = self.shapes[leaf]
                out.append(torch.zeros((rows, last), dtype=torch.float32, device=self.device))
            else:
                out.extend(self.select_leaves([(leaf, tensor)]))
        return out

    def select_leaves(self, leaves: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`select` of some leaves, given by index."""
        out = []
        with torch.no_grad():
            for leaf, tensor in leaves:
                (count, last), _ = self.shapes[leaf]
                values = tensor.detach().reshape(count, last)
                selected = self.rows[leaf]
                if selected is not None:
                    values = values.index_select(0, selected)
                out.append(values.to(torch.float32, copy=True))
        return out

    def project_rows(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """The probes of selected float32 rows (:meth:`select`, or ``post - pre`` rows for
        the delta), leaf after leaf, as one float32 vector on the device."""
        with torch.no_grad():
            parts = [
                project(values, matrix).reshape(-1)
                for values, matrix in zip(rows, self.matrices, strict=True)
            ]
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat(parts)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The probes of one parameter tree, leaf after leaf, as one float32 vector."""
        return self.project_rows(self.select(tensors))

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """A host copy of :meth:`__call__`'s result as one ``(rows, k)`` array per leaf."""
        out = []
        offset = 0
        for _, (rows, k) in self.shapes:
            out.append(flat[offset : offset + rows * k].reshape(rows, k))
            offset += rows * k
        return out
