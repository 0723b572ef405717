"""Functional bridge contract for :class:`torch.optim.NAdam`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.nadam import nadam

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, host_step, pick, scalar_dtype

__all__ = ["NAdamContract"]


class NAdamContract(OptimizerContract):
    """NAdam, Adam with Nesterov momentum (Dozat 2016)."""

    optimizer_type = torch.optim.NAdam

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        if group["capturable"]:
            step = torch.zeros((), dtype=scalar_dtype(), device=parameter.device)
            mu_product = torch.ones((), dtype=scalar_dtype(), device=parameter.device)
        else:
            step, mu_product = host_step(0.0), host_step(1.0)
        return {
            "step": step,
            "mu_product": mu_product,
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
        nadam(
            parameters,
            gradients,
            pick(states, "exp_avg"),
            pick(states, "exp_avg_sq"),
            pick(states, "mu_product"),
            pick(states, "step"),
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum_decay=group["momentum_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            has_complex=has_complex(parameters),
        )
