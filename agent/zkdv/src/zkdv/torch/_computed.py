"""A Torch step's computed values (:mod:`zkdv.gradients`): named for its commitment, and
read back from its gradient file for a sampled check.

A step commits the gradients its update read, every buffer after the step and a
prepared GradScaler's state after it. :func:`computed_leaves` names them as the
transcript does; :func:`committed_values` reads a committed step's back, so a sampled
check applies the canonical update to what was committed (as the platform's replay
does) and compares what it recomputes within the run's gradient bounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.tensor import DTensor

from zkdv.files import gradient_path, read_state
from zkdv.gradients import compare, leaf_name
from zkdv.torch._arrays import host_array, tensor_like
from zkdv.torch._pipeline import CommittedValues
from zkdv.torch.optimizers.bridge import SCALER, SCALER_ENTRIES

if TYPE_CHECKING:
    from pathlib import Path

    from zkdv.config import GradientBounds, ZKDVConfig
    from zkdv.driver import Runtime
    from zkdv.torch._model import PreparedModel

__all__ = ["ComputedHost", "committed_values", "computed_leaves"]


class _Names(Protocol):
    @property
    def parameter_names(self) -> tuple[str, ...]: ...

    @property
    def buffer_names(self) -> tuple[str, ...]: ...


class _ScalerState(Protocol):
    def live_state(self) -> dict[str, torch.Tensor]: ...


class ComputedHost(Protocol):
    """What the computed values read of the driver (:class:`zkdv.torch.ZKDV`): the run's
    directory, configuration and bounds, the committed names, the prepared model and
    GradScaler, and which parameters train. Stated here so that this module does not
    import the driver."""

    @property
    def runtime(self) -> Runtime: ...

    @property
    def path(self) -> Path: ...

    @property
    def config(self) -> ZKDVConfig: ...

    @property
    def _layout(self) -> _Names: ...

    @property
    def _prepared_scaler(self) -> _ScalerState | None: ...

    @property
    def _trained(self) -> tuple[bool, ...] | None: ...

    @property
    def _bounds(self) -> GradientBounds | None: ...

    def _require_prepared_model(self) -> PreparedModel: ...


def computed_leaves(
    proof: ComputedHost,
    gradients: list[torch.Tensor | None],
    post_buffers: list[torch.Tensor],
    *,
    scaler_state: list[torch.Tensor] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """A step's computed values, named (:mod:`zkdv.gradients`): the gradients the
    update read, every buffer after the step, a GradScaler's state after it (the live
    one, or ``scaler_state``: ``(growth_tracker, scale)``)."""
    layout = proof._layout
    leaves = [
        (leaf_name("params", name), gradient)
        for name, gradient in zip(layout.parameter_names, gradients, strict=True)
        if gradient is not None
    ]
    leaves += [
        (leaf_name("buffers", name), buffer)
        for name, buffer in zip(layout.buffer_names, post_buffers, strict=True)
    ]
    scaler = proof._prepared_scaler
    if scaler is not None:
        state = (
            scaler.live_state()
            if scaler_state is None
            else dict(zip(SCALER_ENTRIES, scaler_state, strict=True))
        )
        leaves += [
            (leaf_name("opt_state", f"{SCALER}.{entry}"), state[entry].detach())
            for entry in SCALER_ENTRIES
        ]
    return leaves


def committed_values(proof: ComputedHost, step: int) -> CommittedValues | None:
    """Step ``step``'s committed computed values, read back from its gradient file.

    What a sampled check applies the canonical update to, as the platform's replay
    does: None where the run keeps no files (``ZKDV_KEEP_FILES=0``), and the check
    then recomputes every step of its window.
    """
    core = proof.runtime.core
    path = gradient_path(proof.path, step)
    if core is None or core.grad_specs is None or not path.exists():
        return None
    leaves, _ = read_state(path, core.grad_specs, core.config.chunk_bytes)
    values = dict(leaves)
    model = proof._require_prepared_model()
    gradients: list[torch.Tensor | None] = [
        tensor_like(values[leaf_name("params", name)], _whole(parameter))
        if leaf_name("params", name) in values
        else None
        for name, parameter in zip(model.parameter_names, model.state_parameters, strict=True)
    ]
    buffers = [
        tensor_like(values[leaf_name("buffers", name)], buffer)
        for name, buffer in zip(model.buffer_names, model.buffers, strict=True)
    ]
    scaler = None
    prepared = proof._prepared_scaler
    if prepared is not None:
        present = [g for g in gradients if g is not None]
        overflow = not all(bool(torch.isfinite(g).all()) for g in present)
        live = prepared.live_state()
        scaler = [
            torch.tensor(1.0 if overflow else 0.0),
            *(
                tensor_like(values[leaf_name("opt_state", f"{SCALER}.{entry}")], live[entry])
                for entry in SCALER_ENTRIES
            ),
        ]
    bounds = proof.config.gradient_bounds or proof._bounds
    assert bounds is not None

    def within(
        recomputed: list[torch.Tensor | None],
        buffers_after: list[torch.Tensor],
        scaler_after: list[torch.Tensor] | None,
    ) -> bool:
        trained = proof._trained or ()
        named = computed_leaves(
            proof,
            [g if train else None for g, train in zip(recomputed, trained, strict=True)],
            buffers_after,
            scaler_state=None if scaler_after is None else scaler_after[1:],
        )
        replayed = [(name, host_array(t)) for name, t in named]
        return compare(replayed, leaves, bounds).ok

    return CommittedValues(gradients, buffers, scaler, within)


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """A tensor like ``parameter`` as a whole: under FSDP2 a plain tensor of the full
    shape (the committed gradient is the full one), not a DTensor shard."""
    if isinstance(parameter, DTensor):
        return torch.empty(parameter.shape, dtype=parameter.dtype, device=parameter.device)
    return parameter
