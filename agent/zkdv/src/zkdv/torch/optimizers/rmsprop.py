"""Functional bridge contract for :class:`torch.optim.RMSprop`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.rmsprop import rmsprop

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, scalar_dtype

__all__ = ["RMSpropContract"]


class RMSpropContract(OptimizerContract):
    """RMSprop (Hinton, lecture 6e), optionally centered and with momentum."""

    optimizer_type = torch.optim.RMSprop

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        device = parameter.device if group["capturable"] else None
        state = {
            "step": torch.zeros((), dtype=scalar_dtype(), device=device),
            "square_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(
                parameter, memory_format=torch.preserve_format
            )
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return state

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        rmsprop(
            parameters,
            gradients,
            pick(states, "square_avg"),
            pick(states, "grad_avg") if group["centered"] else [],
            pick(states, "momentum_buffer") if group["momentum"] > 0 else [],
            pick(states, "step"),
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            centered=group["centered"],
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            capturable=group["capturable"],
            has_complex=has_complex(parameters),
        )
