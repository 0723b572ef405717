"""Explicit rejection contract for closure-driven LBFGS updates."""

from __future__ import annotations

from typing import Any

import torch

from zkdv.torch.optimizers.base import OptimizerContract

__all__ = ["LBFGS_UNSUPPORTED", "LBFGSContract"]

LBFGS_UNSUPPORTED = (
    "ZKDV cannot attest torch.optim.LBFGS: its step re-evaluates a closure a "
    "data-dependent number of times; call proof.register_functional_optimizer("
    "torch.optim.LBFGS, contract) with a functional OptimizerContract"
)


class LBFGSContract(OptimizerContract):
    """Reject LBFGS with the instruction to register a functional contract."""

    optimizer_type = torch.optim.LBFGS

    def validate(self, optimizer: torch.optim.Optimizer) -> None:
        raise ValueError(LBFGS_UNSUPPORTED)

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(LBFGS_UNSUPPORTED)

    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        raise ValueError(LBFGS_UNSUPPORTED)
