"""Eager-facing objects returned by :meth:`zkdv.torch.ZKDV.prepare`.

A prepared model is the user's own module, unchanged: its layout is bound inside the
proof. A prepared optimizer is a :class:`PreparedOptimizer`, which keeps the
``torch.optim.Optimizer`` API and native eager behaviour: outside a transaction its
``step()`` is the wrapped optimizer's; inside ``proof.transaction(...)`` it is the same
native step bracketed by the mutation barrier and the pre-update probe rows; inside the
traced ``@proof.attest`` function it marks the transition that the optimizer's
functional contract applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zkdv.torch import _update
from zkdv.torch._capture import current_capture
from zkdv.torch._eager import current_transaction
from zkdv.torch.optimizers.bridge import OptimizerBridge

if TYPE_CHECKING:
    from zkdv.torch._update import UpdateHost

__all__ = ["PreparedOptimizer"]


class PreparedOptimizer(torch.optim.Optimizer):
    """Preserve the Optimizer API while routing steps through ZKDV.

    Args:
        proof: the owning proof.
        optimizer: the user's optimizer, which keeps its state and groups.
        bridge: its functional bridge.
    """

    def __init__(
        self, proof: UpdateHost, optimizer: torch.optim.Optimizer, bridge: OptimizerBridge
    ):
        # Deliberately not Optimizer.__init__: groups, state and hooks stay the wrapped
        # optimizer's, so schedulers, checkpoints and hooks see one source of truth.
        self.proof = proof
        self.optimizer = optimizer
        self.bridge = bridge

    # The wrapped optimizer's attributes, shared rather than copied.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a PreparedOptimizer is bound to its proof; pickle .optimizer instead")

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Take one optimizer step (see the module docstring for the three contexts)."""
        capture = current_capture()
        if capture is not None:
            capture.step(self)
            return None
        transaction = current_transaction()
        if transaction is None or transaction.proof is not self.proof:
            return self.optimizer.step(closure)
        return _update.step(self.proof, transaction, self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; inside the traced attested function, gradients are values."""
        if current_capture() is not None:
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "prepared optimizer parameter groups are fixed by attestation; create a new "
            "proof to train more parameters"
        )
