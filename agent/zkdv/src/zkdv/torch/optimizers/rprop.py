"""Functional bridge contract for :class:`torch.optim.Rprop`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.rprop import rprop

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, scalar_dtype

__all__ = ["RpropContract"]


class RpropContract(OptimizerContract):
    """Resilient backpropagation (Riedmiller and Braun 1993)."""

    optimizer_type = torch.optim.Rprop

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        device = parameter.device if group["capturable"] else None
        lr = float(group["lr"])
        initial = complex(lr, lr) if parameter.dtype.is_complex else lr
        return {
            "step": torch.zeros((), dtype=scalar_dtype(), device=device),
            "prev": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            "step_size": torch.full_like(parameter, initial),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        rprop(
            parameters,
            gradients,
            pick(states, "prev"),
            pick(states, "step_size"),
            pick(states, "step"),
            step_size_min=step_size_min,
            step_size_max=step_size_max,
            etaminus=etaminus,
            etaplus=etaplus,
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            capturable=group["capturable"],
            has_complex=has_complex(parameters),
        )
