"""Proof-aware execution context for lowering an attested Torch transition.

While an :class:`AttestationCapture` is active (only while ZKDV traces the attested
function), ``proof.forward`` calls the prepared module with the capture's tensors,
``proof.backward`` computes gradients with respect to them, and the prepared
optimizer's ``step()`` marks the optimizer transition, which is then applied by the
optimizer's functional contract. Outside a capture these calls are ordinary eager
Torch.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

import torch

__all__ = ["AttestationCapture", "current_capture"]

_CURRENT: ContextVar[AttestationCapture | None] = ContextVar("zkdv_torch_capture", default=None)


def current_capture() -> AttestationCapture | None:
    """The capture of the attested function being traced, or None in eager code."""
    return _CURRENT.get()


class AttestationCapture:
    """Collect gradients and the optimizer transition during attested execution.

    Args:
        model: the prepared model (:class:`~zkdv.torch.model.PreparedModel`).
        model_state: ``(parameters, buffers)`` standing in for the module's state;
            the buffers are cloned, so in-place buffer updates (BatchNorm running
            statistics) land on the capture's copies.
        optimizer: the prepared optimizer whose ``step()`` the function calls.
        optimizer_state: the optimizer state standing in for the live one, or None.
    """

    def __init__(
        self,
        model: Any,
        model_state: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        optimizer: Any,
        optimizer_state: Any,
    ) -> None:
        self.model = model
        self._buffers_before = model_state[1]
        self.model_state = (
            model_state[0],
            tuple(buffer.clone() for buffer in model_state[1]),
        )
        self.optimizer = optimizer
        self.optimizer_state = optimizer_state
        self.gradients: list[torch.Tensor | None] | None = None
        self.transition: Any = None
        self._token: Token[AttestationCapture | None] | None = None

    def backward(self, loss: torch.Tensor, gradient: Any = None) -> None:
        """Accumulate ``d loss / d parameters`` as ``loss.backward()`` would."""
        parameters = self.model_state[0]
        gradients = torch.autograd.grad(loss, parameters, grad_outputs=gradient, allow_unused=True)
        if self.gradients is None:
            self.gradients = list(gradients)
            return
        self.gradients = [
            new if old is None else old if new is None else old + new
            for old, new in zip(self.gradients, gradients, strict=True)
        ]

    def step(self, optimizer: Any) -> None:
        """Mark the optimizer transition; it must follow a backward pass.

        Raises:
            RuntimeError: a second step, a step of another optimizer, or no gradients.
        """
        if self.transition is not None:
            raise RuntimeError("an attested Torch step may call optimizer.step() once")
        if optimizer is not self.optimizer:
            raise RuntimeError(
                "the attested function stepped an optimizer that was not prepared with "
                "this proof; pass it through proof.prepare() first"
            )
        if self.gradients is None:
            raise RuntimeError("call proof.backward(loss) before optimizer.step()")
        self.transition = optimizer

    def __enter__(self) -> AttestationCapture:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
