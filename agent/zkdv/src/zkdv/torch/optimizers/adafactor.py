"""Functional bridge contract for :class:`torch.optim.Adafactor`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim._adafactor import adafactor

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import host_step

__all__ = ["AdafactorContract"]


class AdafactorContract(OptimizerContract):
    """Adafactor (Shazeer and Stern 2018): factored second moments for matrices."""

    optimizer_type = torch.optim.Adafactor

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {"step": host_step()}
        if parameter.dim() > 1:
            row_shape = list(parameter.shape)
            row_shape[-1] = 1
            col_shape = list(parameter.shape)
            col_shape[-2] = 1
            state["row_var"] = parameter.new_zeros(row_shape)
            state["col_var"] = parameter.new_zeros(col_shape)
        else:
            state["variance"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return state

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        eps1, eps2 = group["eps"]
        adafactor(
            parameters,
            gradients,
            [state.get("row_var") for state in states],
            [state.get("col_var") for state in states],
            [state.get("variance") for state in states],
            [state["step"] for state in states],
            d=group["d"],
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            weight_decay=group["weight_decay"],
            eps1=eps1,
            eps2=eps2,
            foreach=group["foreach"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=None,
            has_complex=False,
        )
