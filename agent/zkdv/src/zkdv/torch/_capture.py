"""Proof-aware execution context for lowering an attested Torch transition.

While an :class:`AttestationCapture` is active (only while ZKDV traces the attested
function), ``proof.forward`` calls the prepared module with the capture's tensors and
``proof.backward`` differentiates the loss with respect to them, as ``loss.backward()``
would: each gradient lands in the live parameter's ``.grad`` (added to what is already
there, so several micro-batches accumulate). Whatever the function then does to the
gradients before ``optimizer.step()`` (``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_``, a ``GradScaler``'s unscaling, a hand-written scaling) runs on the
traced gradients and is recorded with them. The prepared optimizer's ``step()`` marks
the transition: the gradients it reads are the parameters' ``.grad`` at that moment.
When the capture ends, every parameter's ``.grad`` is restored to what it was before.
Outside a capture these calls are ordinary eager Torch.

``loss.backward()`` works inside the capture too (a Torch function mode routes
``Tensor.backward`` to :meth:`AttestationCapture.backward`), so a step that frameworks
write for you (Hugging Face's ``Trainer.training_step``, which calls Accelerate's
``backward``, or Lightning's closure) is attested as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar, Token
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["AttestationCapture", "current_capture"]

_CURRENT: ContextVar[AttestationCapture | None] = ContextVar("zkdv_torch_capture", default=None)

NO_BACKWARD = "call proof.backward(loss) before optimizer.step()"
TWO_STEPS = "an attested Torch step may call optimizer.step() once"
BACKWARD_OPTIONS = (
    "loss.backward({options}) inside the attested step is not supported; call "
    "loss.backward() (or proof.backward(loss)) and let the step differentiate with respect "
    "to every trained parameter"
)
FOREIGN_OPTIMIZER = (
    "the attested function stepped an optimizer that was not prepared with this proof; "
    "pass it through proof.prepare() first"
)


def current_capture() -> AttestationCapture | None:
    """The capture of the attested function being traced, or None in eager code."""
    return _CURRENT.get()


class AttestationCapture:
    """Collect gradients and the optimizer transition during attested execution.

    Args:
        model: the prepared model (:class:`~zkdv.torch._model.PreparedModel`).
        model_state: ``(parameters, buffers)`` standing in for the module's state;
            the buffers are cloned, so in-place buffer updates (BatchNorm running
            statistics) land on the capture's copies.
        optimizer: the prepared optimizer whose ``step()`` the function calls.
        live: the module's own parameters, in the order of ``model_state``'s: their
            ``.grad`` carries the traced gradients while the capture is active.
        gradients_on_live: route gradients through ``live[i].grad`` (False under FSDP2,
            whose live parameters are shards of another shape: gradients are then only
            values, and nothing may modify them before the step).
    """

    def __init__(
        self,
        model: Any,
        model_state: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        optimizer: Any,
        live: Sequence[torch.Tensor],
        *,
        gradients_on_live: bool = True,
        held: Sequence[bool] | None = None,
        scaler_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.model_state = (
            model_state[0],
            tuple(buffer.clone() for buffer in model_state[1]),
        )
        self.optimizer = optimizer
        self.live = tuple(live)
        self._on_live = gradients_on_live
        #: Per parameter, whether the optimizer holds it (a GradScaler unscales those).
        self.held = tuple(held) if held is not None else (True,) * len(self.live)
        #: A prepared GradScaler's traced state (scale, growth tracker), updated in place.
        self.scaler_state = scaler_state
        #: Whether the gradients overflowed, once a prepared GradScaler unscaled them.
        self.found_inf: torch.Tensor | None = None
        self._saved: list[torch.Tensor | None] = []
        #: The gradients as the last ``proof.backward`` left them (before any clipping).
        self.raw: list[torch.Tensor | None] | None = None
        self.raw_versions: list[int | None] = []
        self._values: list[torch.Tensor | None] | None = None
        #: The gradients ``optimizer.step()`` read, in model parameter order.
        self.gradients: list[torch.Tensor | None] | None = None
        self.transition: Any = None
        self.backward_calls = 0
        self._token: Token[AttestationCapture | None] | None = None
        self._mode: _RouteBackward | None = None

    def backward(self, loss: torch.Tensor, gradient: Any = None) -> None:
        """Add ``d loss / d parameters`` to the parameters' gradients, as backward does."""
        parameters = self.model_state[0]
        wanted = [index for index, p in enumerate(parameters) if p.requires_grad]
        found: Sequence[torch.Tensor | None] = torch.autograd.grad(
            loss, [parameters[index] for index in wanted], grad_outputs=gradient, allow_unused=True
        )
        current = self._current()
        for index, new in zip(wanted, found, strict=True):
            if new is None:
                continue
            old = current[index]
            current[index] = new if old is None else old + new
        self._store(current)
        self.raw = list(current)
        self.raw_versions = [None if g is None else g._version for g in current]
        self.backward_calls += 1

    def current_gradients(self) -> list[torch.Tensor | None]:
        """The gradients of the parameters the optimizer holds, as they are now."""
        return [g if held else None for g, held in zip(self._current(), self.held, strict=True)]

    def _current(self) -> list[torch.Tensor | None]:
        if self._on_live:
            # The traced parameters' .grad: what model.parameters() yields in the step
            # (the live parameters' .grad holds the same tensors, for optimizer views).
            return [parameter.grad for parameter in self.model_state[0]]
        return list(self._values or [None] * len(self.live))

    def _store(self, gradients: list[torch.Tensor | None]) -> None:
        if not self._on_live:
            self._values = gradients
            return
        for live, traced, value in zip(self.live, self.model_state[0], gradients, strict=True):
            live.grad = value
            traced.grad = value

    def modified(self) -> bool:
        """Whether the gradients the step read differ from what the last backward left.

        True when a gradient was replaced or changed in place (clipping, unscaling).
        """
        if self.raw is None or self.gradients is None:
            return True
        return any(
            a is not b or (a is not None and a._version != version)
            for a, b, version in zip(self.raw, self.gradients, self.raw_versions, strict=True)
        )

    def step(self, optimizer: Any) -> None:
        """Mark the optimizer transition; it must follow a backward pass.

        Raises:
            RuntimeError: a second step, a step of another optimizer, or no gradients.
        """
        if self.transition is not None:
            raise RuntimeError(TWO_STEPS)
        if optimizer is not self.optimizer:
            raise RuntimeError(FOREIGN_OPTIMIZER)
        if not self.backward_calls:
            raise RuntimeError(NO_BACKWARD)
        self.gradients = self._current()
        self.transition = optimizer

    def __enter__(self) -> AttestationCapture:
        if self._on_live:
            self._saved = [parameter.grad for parameter in self.live]
            for parameter in self.live:
                parameter.grad = None
        self._token = _CURRENT.set(self)
        self._mode = _RouteBackward(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._mode = None
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        if self._on_live:
            for parameter, saved in zip(self.live, self._saved, strict=True):
                parameter.grad = saved
            self._saved = []


class _RouteBackward(TorchFunctionMode):
    """``loss.backward()`` in the attested step does what ``proof.backward(loss)`` does."""

    def __init__(self, capture: AttestationCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            return func(*args, **kwargs)
        loss, *rest = args
        options = dict(
            zip(("gradient", "retain_graph", "create_graph", "inputs"), rest, strict=False)
        )
        options.update(kwargs)
        gradient = options.pop("gradient", None)
        # retain_graph only keeps buffers alive in eager autograd; the trace needs none.
        options.pop("retain_graph", None)
        used = {name: value for name, value in options.items() if value not in (None, False)}
        if used:
            raise RuntimeError(BACKWARD_OPTIONS.format(options=", ".join(f"{k}=..." for k in used)))
        self.capture.backward(loss, gradient)
        return None
