"""Flat tensor utilities shared by functional optimizer contracts."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["has_complex", "host_step", "pick", "scalar_dtype", "step_counter"]


def scalar_dtype(*, fused: bool | None = None) -> torch.dtype:
    """The dtype ``torch.optim`` uses for scalar state such as ``step``."""
    return cast(torch.dtype, _get_scalar_dtype(is_fused=fused))  # type: ignore[no-untyped-call]


def host_step(value: float = 0.0) -> torch.Tensor:
    """A scalar step counter on the host, as non-capturable optimizers keep it."""
    return torch.tensor(value, dtype=scalar_dtype())


def step_counter(parameter: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The ``step`` tensor ``torch.optim`` creates: on the device when capturable or fused.

    Non-capturable optimizers deliberately keep ``step`` on the host because a kernel
    launch per scalar is costly on accelerators (torch.optim's "special device
    hosting for step").
    """
    fused = bool(group.get("fused") or False)
    if group.get("capturable", False) or fused:
        return torch.zeros((), dtype=scalar_dtype(fused=fused), device=parameter.device)
    return host_step()


def has_complex(parameters: list[torch.Tensor]) -> bool:
    return any(torch.is_complex(parameter) for parameter in parameters)


def pick(states: list[dict[str, Any]], name: str) -> list[Any]:
    """The ``name`` entry of every state, in order."""
    return [state[name] for state in states]
