"""Loss scaling (``torch.amp.GradScaler``) inside the attested transition.

fp16 training multiplies the loss by a scale before the backward pass, divides the
gradients by it before the optimizer step, skips the step when a gradient overflowed,
and adapts the scale: halved after an overflow, doubled after ``growth_interval`` clean
steps. All of it is part of the transition, so a prepared scaler
(:class:`PreparedGradScaler`, from ``proof.prepare(scaler)``) makes it so:

* its two tensors, the scale and the growth tracker, are committed with the optimizer
  state, as leaves ``grad_scaler.growth_tracker`` and ``grad_scaler.scale`` after every
  parameter's entries;
* in eager code every method is the native scaler's; a step the scaler skips (an
  overflow) is still a committed step, in which only the scaler's state changes;
* while the attested step is traced, ``scale``, ``unscale_``, ``step`` and ``update`` run
  the native scaler's own kernels (``_amp_foreach_non_finite_check_and_unscale_``,
  ``_amp_update_scale_``) on the traced gradients and the traced scaler state, without
  the native step's data-dependent branch: the program returns whether the gradients
  overflowed, and a replay applies the optimizer update only when they did not.

The options (``growth_factor``, ``backoff_factor``, ``growth_interval``) are fixed by
``prepare()`` and recorded in the root record's ``env.grad_scaler``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zkdv.torch import _update
from zkdv.torch._capture import current_capture
from zkdv.torch.optimizers.bridge import SCALER
from zkdv.torch.optimizers.bridge import SCALER_ENTRIES as ENTRIES

if TYPE_CHECKING:
    from zkdv.torch._update import UpdateHost

__all__ = ["ENTRIES", "SCALER", "PreparedGradScaler", "apply_update", "unscale"]

TWO_UNSCALES = "unscale_() has already been called on this optimizer since the last update()"
NEW_SCALE = (
    "scaler.update(new_scale) inside the attested step is not supported: the scale is "
    "committed state, changed only by the scaler's own rule"
)


def unscale(gradients: list[torch.Tensor | None], scale: torch.Tensor) -> torch.Tensor:
    """Divide ``gradients`` by ``scale`` in place as ``GradScaler.unscale_`` does.

    Returns:
        ``found_inf``: 1.0 when a gradient holds an inf or a NaN, else 0.0.
    """
    # The scaler's own arithmetic: the reciprocal in float64, then float32.
    inv_scale = scale.double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for gradient in gradients:
        if gradient is not None:
            groups.setdefault((gradient.device, gradient.dtype), []).append(gradient)
    for (device, _), group in groups.items():
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found_inf.to(device), inv_scale.to(device)
        )
    return found_inf


def apply_update(
    scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor, options: Any
) -> None:
    """The scaler's rule, in place: back off after an overflow, grow after a clean run."""
    torch._amp_update_scale_(
        scale,
        growth_tracker,
        found_inf.to(scale.device),
        float(options["growth_factor"]),
        float(options["backoff_factor"]),
        int(options["growth_interval"]),
    )


def _state(capture: Any) -> dict[str, torch.Tensor]:
    state = capture.scaler_state
    if state is None:
        raise RuntimeError(
            "the GradScaler was prepared after the attested program was sealed; prepare it "
            "with the model and optimizer, before the first transaction"
        )
    return state  # type: ignore[no-any-return]


class PreparedGradScaler:
    """A ``torch.amp.GradScaler`` whose state and steps are part of the proof.

    Args:
        proof: the owning proof.
        scaler: the user's scaler, which keeps its state.
        device: where its state lives (the model's device).
    """

    def __init__(
        self, proof: UpdateHost, scaler: torch.amp.GradScaler, device: torch.device
    ) -> None:
        self.proof = proof
        self.scaler = scaler
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(device)
        self.options = {
            "growth_factor": float(scaler.get_growth_factor()),
            "backoff_factor": float(scaler.get_backoff_factor()),
            "growth_interval": int(scaler.get_growth_interval()),
        }

    def __repr__(self) -> str:
        return f"PreparedGradScaler({self.scaler!r})"

    # --- committed state -----------------------------------------------------------------
    def live_state(self) -> dict[str, torch.Tensor]:
        """The scaler's state tensors, uncopied, keyed by :data:`ENTRIES`."""
        scale, growth = self.scaler._scale, self.scaler._growth_tracker
        assert scale is not None and growth is not None
        return {"growth_tracker": growth, "scale": scale}

    # --- the GradScaler API --------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        capture = current_capture()
        if capture is None:
            return self.scaler.scale(outputs)
        scale = _state(capture)["scale"]
        if isinstance(outputs, torch.Tensor):
            return outputs * scale.to(device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(output) for output in outputs)
        raise ValueError("outputs must be a Tensor or a list or tuple of Tensors")

    def unscale_(self, optimizer: Any) -> None:
        capture = current_capture()
        if capture is None:
            self.scaler.unscale_(optimizer)
            return
        if capture.found_inf is not None:
            raise RuntimeError(TWO_UNSCALES)
        gradients = capture.current_gradients()
        capture.found_inf = unscale(gradients, _state(capture)["scale"])

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        capture = current_capture()
        if capture is None:
            result = self.scaler.step(optimizer, *args, **kwargs)
            # A step the scaler skipped (an overflow) is still a committed step.
            _update.skipped_by_scaler(self.proof, optimizer)
            return result
        if capture.found_inf is None:
            self.unscale_(optimizer)
        # No branch on the overflow: the program returns it, and a replay applies the
        # optimizer update only without one.
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        capture = current_capture()
        if capture is None:
            self.scaler.update(new_scale)
            return
        if new_scale is not None:
            raise RuntimeError(NEW_SCALE)
        state = _state(capture)
        found_inf = capture.found_inf
        assert found_inf is not None, "scaler.update() before scaler.step()"
        apply_update(state["scale"], state["growth_tracker"], found_inf, self.options)

    def get_scale(self) -> float:
        return self.scaler.get_scale()

    def is_enabled(self) -> bool:
        return self.scaler.is_enabled()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
