"""Functional bridge contract for :class:`torch.optim.SGD`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.sgd import sgd

from zkdv.torch.optimizers.base import OptimizerContract

__all__ = ["SGDContract"]


class SGDContract(OptimizerContract):
    """Stochastic gradient descent, with optional (Nesterov) momentum.

    ``torch.optim.SGD`` creates a parameter's momentum buffer on its first step as a
    copy of the gradient (not from zeros: with dampening the two differ), so the
    buffer starts as ``None`` here too and native behaviour is unchanged. The
    committed state shows an absent buffer as zeros.
    """

    optimizer_type = torch.optim.SGD

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"momentum_buffer": None} if group["momentum"] != 0 else {}

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        momentum = group["momentum"]
        buffers: list[torch.Tensor | None] = (
            [state.get("momentum_buffer") for state in states] if momentum != 0 else []
        )
        sgd(
            parameters,
            gradients,
            buffers,
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=any(gradient.is_sparse for gradient in gradients),
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
        )
        if momentum != 0:
            for state, buffer in zip(states, buffers, strict=True):
                state["momentum_buffer"] = buffer
