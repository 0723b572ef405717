"""Functional bridge contract for :class:`torch.optim.Adamax`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adamax import adamax

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, step_counter

__all__ = ["AdamaxContract"]


class AdamaxContract(OptimizerContract):
    """Adamax, the infinity-norm variant of Adam (Kingma and Ba 2015, section 7)."""

    optimizer_type = torch.optim.Adamax

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": step_counter(parameter, group),
            "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            "exp_inf": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        beta1, beta2 = group["betas"]
        adamax(
            parameters,
            gradients,
            pick(states, "exp_avg"),
            pick(states, "exp_inf"),
            pick(states, "step"),
            eps=group["eps"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            capturable=group["capturable"],
            has_complex=has_complex(parameters),
        )
