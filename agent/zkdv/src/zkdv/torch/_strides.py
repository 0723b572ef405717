"""Memory formats (dimension orders) of committed tensors, kept by every replay.

Commitments, snapshot files and the batch words hold tensors in logical (C) order. But
Torch picks kernels by memory format: a convolution over ``channels_last`` weights and
inputs runs another oneDNN kernel, and rounds differently, than over contiguous ones.
A replay that rebuilt every tensor contiguous would compute something other than the
training step it checks. So the root record keeps the dimension order of every
parameter, buffer and optimizer-state leaf, and of every batch tensor, that is not
plain C order (``env.dim_orders``, ``env.batch.leaves[i].dim_order``), and both the
SDK's snapshots and the platform's replay rebuild tensors in those orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["dim_order", "empty_in_order", "in_order", "orders"]


def dim_order(tensor: torch.Tensor) -> list[int] | None:
    """The tensor's dimension order, outermost first; None for C order (or none)."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    try:
        order = list(tensor.dim_order())
    except RuntimeError:  # overlapping or irregular strides: only C order is rebuilt
        return None
    return None if order == list(range(tensor.dim())) else order


def empty_in_order(
    shape: Sequence[int],
    order: Sequence[int] | None,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out in ``order`` (None: C order)."""
    if order is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
    return torch.empty_permuted(
        tuple(shape), tuple(order), dtype=dtype, device=device, pin_memory=pin_memory
    )


def in_order(tensor: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """``tensor``'s values laid out in ``order`` (itself when it already is)."""
    if order is None or dim_order(tensor) == list(order):
        return tensor
    out = empty_in_order(tensor.shape, order, dtype=tensor.dtype, device=tensor.device)
    out.copy_(tensor)
    return out


def orders(names: Sequence[str], tensors: Sequence[Any]) -> dict[str, list[int]]:
    """The leaves not in C order, by name (the root record's ``env.dim_orders`` part)."""
    found = {}
    for name, tensor in zip(names, tensors, strict=True):
        order = dim_order(tensor) if isinstance(tensor, torch.Tensor) else None
        if order is not None:
            found[name] = order
    return found
