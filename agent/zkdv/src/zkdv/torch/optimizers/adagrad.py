"""Functional bridge contract for :class:`torch.optim.Adagrad`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adagrad import adagrad

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import has_complex, pick, step_counter

__all__ = ["AdagradContract"]


class AdagradContract(OptimizerContract):
    """Adagrad (Duchi et al. 2011)."""

    optimizer_type = torch.optim.Adagrad

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        initial = group["initial_accumulator_value"]
        value = complex(initial, initial) if torch.is_complex(parameter) else initial
        return {
            # Adagrad has no capturable mode: step is on the device only when fused.
            "step": step_counter(parameter, {"fused": group.get("fused")}),
            "sum": torch.full_like(parameter, value, memory_format=torch.preserve_format),
        }

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        adagrad(
            parameters,
            gradients,
            pick(states, "sum"),
            pick(states, "step"),
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            lr_decay=group["lr_decay"],
            eps=group["eps"],
            has_sparse_grad=any(gradient.is_sparse for gradient in gradients),
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=False,
            has_complex=has_complex(parameters),
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
        )
