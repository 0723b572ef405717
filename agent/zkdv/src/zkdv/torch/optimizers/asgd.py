"""Functional bridge contract for :class:`torch.optim.ASGD`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.asgd import asgd

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, scalar_dtype

__all__ = ["ASGDContract"]


class ASGDContract(OptimizerContract):
    """Averaged SGD (Polyak and Juditsky 1992)."""

    optimizer_type = torch.optim.ASGD

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype, device = scalar_dtype(), parameter.device
        return {
            "step": torch.zeros((), device=device, dtype=dtype),
            "eta": torch.as_tensor(float(group["lr"]), device=device, dtype=dtype).clone(),
            "mu": torch.ones((), device=device, dtype=dtype),
            "ax": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        asgd(
            parameters,
            gradients,
            pick(states, "ax"),
            pick(states, "mu"),
            pick(states, "eta"),
            pick(states, "step"),
            lambd=group["lambd"],
            lr=group["lr"],
            t0=group["t0"],
            alpha=group["alpha"],
            weight_decay=group["weight_decay"],
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            capturable=group["capturable"],
            has_complex=has_complex(parameters),
        )
