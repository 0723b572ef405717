"""Functional bridge contract for :class:`torch.optim.Adam`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.optim.adam import adam

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, step_counter

__all__ = ["AdamContract"]


class AdamContract(OptimizerContract):
    """Adam (Kingma and Ba 2015), and AdamW through ``decoupled_weight_decay``."""

    optimizer_type: ClassVar[type[torch.optim.Optimizer] | None] = torch.optim.Adam

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = {
            "step": step_counter(parameter, group),
            "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(
                parameter, memory_format=torch.preserve_format
            )
        return state

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        beta1, beta2 = group["betas"]
        adam(
            parameters,
            gradients,
            pick(states, "exp_avg"),
            pick(states, "exp_avg_sq"),
            pick(states, "max_exp_avg_sq") if group["amsgrad"] else [],
            pick(states, "step"),
            amsgrad=group["amsgrad"],
            has_complex=has_complex(parameters),
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        )
