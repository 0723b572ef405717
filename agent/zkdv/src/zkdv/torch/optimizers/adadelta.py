"""Functional bridge contract for :class:`torch.optim.Adadelta`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adadelta import adadelta

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, scalar_dtype

__all__ = ["AdadeltaContract"]


class AdadeltaContract(OptimizerContract):
    """Adadelta (Zeiler 2012)."""

    optimizer_type = torch.optim.Adadelta

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        device = parameter.device if group["capturable"] else None
        return {
            "step": torch.zeros((), dtype=scalar_dtype(), device=device),
            "square_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            "acc_delta": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        adadelta(
            parameters,
            gradients,
            pick(states, "square_avg"),
            pick(states, "acc_delta"),
            pick(states, "step"),
            lr=group["lr"],
            rho=group["rho"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            capturable=group["capturable"],
            has_complex=has_complex(parameters),
        )
