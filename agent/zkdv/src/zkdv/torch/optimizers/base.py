"""Contract between an eager Torch optimizer and its functional update.

A contract names the tensor state one ``torch.optim`` optimizer keeps per parameter
(:meth:`OptimizerContract.initialize`, created eagerly so the committed layout is fixed
from the first step) and applies one parameter group's update through the optimizer's
own functional core (:meth:`OptimizerContract.update`, e.g. ``torch.optim.adam.adam``).
The SDK's sampled checks and the platform's replay call the same function that
``Optimizer.step`` calls, so they share one implementation (STYLE rule 12).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

__all__ = [
    "DIFFERENTIABLE_UNSUPPORTED",
    "TENSOR_OPTIONS_UNSUPPORTED",
    "OptimizerContract",
]

DIFFERENTIABLE_UNSUPPORTED = (
    "ZKDV does not support differentiable optimizer steps; "
    "register a custom functional optimizer contract"
)
TENSOR_OPTIONS_UNSUPPORTED = (
    "ZKDV requires static optimizer options, but {names} are tensors; register a "
    "contract that includes dynamic options in optimizer state"
)


class OptimizerContract(ABC):
    """Describe one optimizer's tensor state and functional group update.

    Subclasses set :attr:`optimizer_type` (the exact ``torch.optim`` class they
    describe) and implement :meth:`initialize` and :meth:`update`.
    """

    #: The exact optimizer class this contract describes (subclasses are not matched).
    optimizer_type: ClassVar[type[torch.optim.Optimizer] | None] = None

    @property
    def name(self) -> str:
        """The contract's name as recorded in the transcript's root record."""
        kind = self.optimizer_type
        return kind.__name__ if kind is not None else type(self).__name__

    @abstractmethod
    def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Create the state Torch would lazily initialize for one parameter."""

    @abstractmethod
    def update(
        self,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        """Apply one functional parameter-group update in place.

        Args:
            parameters: the group's parameters that have a gradient, updated in place.
            gradients: their gradients, in the same order.
            states: their state dictionaries, updated in place (entries may be
                replaced, as ``torch.optim.SGD`` replaces an absent momentum buffer).
            group: the parameter group's options.
        """

    def validate(self, optimizer: torch.optim.Optimizer) -> None:
        """Reject modes whose semantics cannot be represented by the bridge.

        Raises:
            ValueError: a differentiable step or a tensor-valued option.
        """
        for group in optimizer.param_groups:
            if group.get("differentiable", False):
                raise ValueError(DIFFERENTIABLE_UNSUPPORTED)
            tensor_options = tuple(
                name for name, value in group.items() if name != "params" and _holds_tensor(value)
            )
            if tensor_options:
                raise ValueError(TENSOR_OPTIONS_UNSUPPORTED.format(names=tensor_options))

    def options(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's static options, as recorded in the transcript (JSON-able)."""
        return {name: _plain(value) for name, value in sorted(group.items()) if name != "params"}


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(isinstance(item, torch.Tensor) for item in value)
    return False


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return repr(value)
