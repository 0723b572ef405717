"""Prepared model state used by Torch functional replay.

:meth:`PreparedModel.bind` fixes a module's committed layout: its parameters in
``named_parameters()`` order (tied parameters once, under their first name), then its
buffers in ``named_buffers()`` order. A ``DistributedDataParallel`` wrapper is
unwrapped (its replicas hold identical state, so rank 0's copy is the logical one);
under FSDP2 (``fully_shard``) each rank holds and commits its local shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["UNPREPARED_MODEL", "PreparedModel", "unwrap"]

UNPREPARED_MODEL = (
    "proof.forward() received an unprepared model; pass it through proof.prepare() first"
)


def unwrap(module: nn.Module) -> tuple[nn.Module, bool]:
    """The module holding the state, and whether a DDP wrapper was removed."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module.module, True
    return module, False


def _is_fsdp(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    return any(isinstance(child, FSDPModule) for child in module.modules())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class PreparedModel:
    """Bind one eager module to a stable parameter and buffer layout.

    Attributes:
        public: the object the user holds and calls (possibly a DDP wrapper).
        target: the module whose parameters and buffers are committed.
        parameter_names: committed parameter leaf paths, in order.
        buffer_names: committed buffer leaf paths, in order.
        distributed: the public object is a DDP wrapper.
        fsdp: the module is sharded by FSDP2; local shards are committed.
        parameter_metadata: ``(shape, dtype, device)`` of every parameter.
        state_parameters: the live parameters, in order.
        state_buffers: the live buffers, in order.
    """

    public: nn.Module
    target: nn.Module
    parameter_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    distributed: bool
    fsdp: bool
    parameter_metadata: tuple[Any, ...]
    state_parameters: tuple[torch.Tensor, ...]
    state_buffers: tuple[torch.Tensor, ...]

    @classmethod
    def bind(cls, module: nn.Module) -> PreparedModel:
        """Fix the layout of ``module``'s state.

        Raises:
            ValueError: the module has no parameters.
        """
        target, distributed = unwrap(module)
        named_parameters = tuple(target.named_parameters())
        if not named_parameters:
            raise ValueError("proof.prepare() needs a model with at least one parameter")
        named_buffers = tuple(target.named_buffers())
        return cls(
            public=module,
            target=target,
            parameter_names=tuple(name for name, _ in named_parameters),
            buffer_names=tuple(name for name, _ in named_buffers),
            distributed=distributed,
            fsdp=_is_fsdp(target),
            parameter_metadata=tuple(
                (tuple(p.shape), p.dtype, p.device) for _, p in named_parameters
            ),
            state_parameters=tuple(parameter for _, parameter in named_parameters),
            state_buffers=tuple(buffer for _, buffer in named_buffers),
        )

    @property
    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The live parameters (local shards under FSDP2), detached."""
        return tuple(_local(parameter).detach() for parameter in self.state_parameters)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The live buffers, in layout order.

        Re-read from the module: a module may rebind a buffer attribute.
        """
        named = dict(self.target.named_buffers())
        return tuple(_local(named[name]).detach() for name in self.buffer_names)

    def forward(
        self,
        model_state: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """Call the module with ``model_state`` substituted for its own state."""
        parameters, buffers = model_state
        state = dict(zip(self.parameter_names, parameters, strict=True))
        state.update(zip(self.buffer_names, buffers, strict=True))
        return torch.func.functional_call(
            self.target, state, tuple(args), dict(kwargs), tie_weights=True, strict=False
        )
