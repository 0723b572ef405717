"""Functional bridge contract for :class:`torch.optim.SparseAdam`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import _functional
from torch.optim.optimizer import _to_scalar

from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.utils import pick

__all__ = ["SparseAdamContract"]


class SparseAdamContract(OptimizerContract):
    """SparseAdam: Adam's moments updated only where a sparse gradient has entries.

    Its ``step`` is a Python int in ``torch.optim`` (not a tensor); the committed
    state records it as an int64 scalar.
    """

    optimizer_type = torch.optim.SparseAdam

    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": 0,
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
        # torch.optim.SparseAdam.step increments the int step before the functional call.
        for state in states:
            state["step"] += 1
        beta1, beta2 = group["betas"]
        _functional.sparse_adam(
            parameters,
            gradients,
            pick(states, "exp_avg"),
            pick(states, "exp_avg_sq"),
            pick(states, "step"),
            eps=group["eps"],
            beta1=beta1,
            beta2=beta2,
            lr=_to_scalar(group["lr"]),
            maximize=group.get("maximize", False),
        )
