"""Contiguous storage for native optimizer state tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["pack_optimizer_state"]


def pack_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Rebind compatible state tensors to shared contiguous backing buffers.

    Same-named, same-shaped state tensors of different parameters (every ``exp_avg``
    of a stack of identical layers, every scalar ``step``) become rows of one buffer,
    so a host copy of the optimizer state is a few large copies, not thousands of
    small ones. Values are copied exactly; the optimizer sees ordinary tensors.
    """
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for parameter, state in optimizer.state.items():
        for name, value in state.items():
            if (
                not isinstance(value, torch.Tensor)
                or isinstance(value, DTensor)
                or value.layout is not torch.strided
            ):
                continue
            key = (name, tuple(value.shape), value.dtype, value.device, value.requires_grad)
            groups.setdefault(key, []).append((parameter, value))

    with torch.no_grad():
        for (name, shape, dtype, device, requires_grad), entries in groups.items():
            if len(entries) < 2:
                continue
            buffer = torch.empty(
                (len(entries), *shape), dtype=dtype, device=device, requires_grad=requires_grad
            )
            for position, (parameter, value) in enumerate(entries):
                buffer[position].copy_(value)
                optimizer.state[parameter][name] = buffer[position]
