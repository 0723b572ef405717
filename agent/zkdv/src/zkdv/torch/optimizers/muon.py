"""Functional bridge contract for :class:`torch.optim.Muon`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim._muon import muon

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import pick

__all__ = ["MuonContract"]


class MuonContract(OptimizerContract):
    """Muon: momentum orthogonalised by Newton-Schulz iterations (Jordan et al. 2024)."""

    optimizer_type = torch.optim.Muon

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"momentum_buffer": torch.zeros_like(parameter, memory_format=torch.preserve_format)}

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        muon(
            parameters,
            gradients,
            pick(states, "momentum_buffer"),
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            eps=group["eps"],
            ns_steps=group["ns_steps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            has_complex=False,
        )
