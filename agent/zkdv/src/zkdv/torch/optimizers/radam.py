"""Functional bridge contract for :class:`torch.optim.RAdam`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.radam import radam

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, host_step, pick, scalar_dtype

__all__ = ["RAdamContract"]


class RAdamContract(OptimizerContract):
    """RAdam, Adam with a rectified adaptive learning rate (Liu et al. 2020)."""

    optimizer_type = torch.optim.RAdam

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        step = (
            torch.zeros((), dtype=scalar_dtype(), device=parameter.device)
            if group["capturable"]
            else host_step()
        )
        return {
            "step": step,
            "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        beta1, beta2 = group["betas"]
        radam(
            parameters,
            gradients,
            pick(states, "exp_avg"),
            pick(states, "exp_avg_sq"),
            pick(states, "step"),
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            decoupled_weight_decay=group["decoupled_weight_decay"],
            has_complex=has_complex(parameters),
        )
