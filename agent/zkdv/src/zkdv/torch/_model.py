"""Prepared model state used by Torch functional replay.

:meth:`PreparedModel.bind` fixes a module's committed layout: its parameters in
``named_parameters()`` order (tied parameters once, under their first name), then its
buffers in ``named_buffers()`` order. A ``DistributedDataParallel`` wrapper is
unwrapped (its replicas hold identical state, so rank 0's copy is the logical one).
Under FSDP2 (``fully_shard``) each rank holds shards (``DTensor`` parameters); the
committed state is the *full* parameters, gathered on every rank in the same order
(:meth:`PreparedModel.full_parameters`), and the attested program is traced on a plain
copy of the module's structure (:func:`plain_structure`) so that neither tracing nor a
replay runs FSDP2's hooks, which would issue collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

__all__ = [
    "FSDP_DIVIDE",
    "FSDP_PARTIAL",
    "FSDP_PRECISION",
    "FSDP_SUBMESH",
    "UNPREPARED_MODEL",
    "PreparedModel",
    "full",
    "plain_structure",
    "refresh_structure",
    "unwrap",
]

FSDP_PARTIAL = (
    "ZKDV supports FSDP2 only when every parameter is sharded: {names} are not DTensors; "
    "call fully_shard() on the root module too, so that FSDP2 averages every gradient"
)
FSDP_PRECISION = (
    "ZKDV supports FSDP2 only without a MixedPrecisionPolicy ({policy} on {module}): the "
    "replay runs the full model in the parameters' own dtype, so a cast forward or "
    "gradient reduction could not be reproduced"
)
FSDP_DIVIDE = (
    "ZKDV supports FSDP2 only with the default gradient averaging ({module} sets a divide "
    "factor of {factor}); the replay averages the gradients over the world size"
)
FSDP_SUBMESH = (
    "ZKDV supports FSDP2 only on a device mesh spanning every process (world size {world}); "
    "parameter {name} is sharded over a mesh of {size}"
)

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


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole logical value of ``tensor``: a DTensor is all-gathered (a collective).

    Every rank must call it for the same tensors in the same order, on the training
    thread: no collective ever runs on a background thread.
    """
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            gathered: torch.Tensor = tensor.full_tensor()
        return gathered.detach()
    return tensor.detach()


_HOOKS = "hooks"


def _plain_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The user's class under FSDP2's dynamic ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    for base in cls.__mro__[1:]:
        if issubclass(base, nn.Module) and not issubclass(base, FSDPModule):
            return base
    return nn.Module  # pragma: no cover - FSDP2 always subclasses an nn.Module


_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules"})


def _plain_attributes(node: nn.Module) -> dict[str, Any]:
    """``node``'s own attributes without its state, hooks or per-instance bound methods.

    Hook dictionaries are replaced by empty ones; a method bound to ``node`` itself
    (FSDP2's ``register_fsdp_forward_method`` installs one) is dropped, so the class's
    own method runs on the copy.
    """
    attributes: dict[str, Any] = {}
    for name, value in node.__dict__.items():
        if name in _STRUCTURE:
            continue
        if isinstance(value, MethodType) and value.__self__ is node:
            continue
        attributes[name] = type(value)() if _HOOKS in name and isinstance(value, dict) else value
    return attributes


def refresh_structure(live: nn.Module, copy: nn.Module) -> None:
    """Carry attributes set on the live modules since binding (``train()``, options)."""
    for (_, node), (_, copied) in zip(
        live.named_modules(remove_duplicate=False),
        copy.named_modules(remove_duplicate=False),
        strict=True,
    ):
        copied.__dict__.update(_plain_attributes(node))


def plain_structure(module: nn.Module) -> nn.Module:
    """A hook-free copy of ``module``'s structure with full-shape meta parameters.

    ``torch.func.functional_call`` substitutes every parameter and buffer, so the copy's
    parameters are never read: they only carry the full (unsharded) shapes. Each
    module's attributes are shared shallowly (configuration such as ``in_features``),
    its hook dictionaries emptied and its class restored from FSDP2's ``FSDP<Class>``.
    Tied parameters stay tied (one placeholder per tensor).
    """
    memo: dict[int, nn.Parameter] = {}

    def copy(node: nn.Module) -> nn.Module:
        clone = object.__new__(_plain_class(type(node)))
        attributes = _plain_attributes(node)
        parameters: dict[str, nn.Parameter | None] = {}
        for name, parameter in node._parameters.items():
            if parameter is None:
                parameters[name] = None
                continue
            if id(parameter) not in memo:
                placeholder = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
                memo[id(parameter)] = nn.Parameter(placeholder, parameter.requires_grad)
            parameters[name] = memo[id(parameter)]
        attributes["_parameters"] = parameters
        attributes["_buffers"] = dict(node._buffers)
        attributes["_modules"] = {
            name: None if child is None else copy(child) for name, child in node._modules.items()
        }
        clone.__dict__.update(attributes)
        return clone

    return copy(module)


def _check_fsdp_policies(target: nn.Module, world: int) -> None:
    """Reject FSDP2 options under which a full-model replay is not FSDP2's update.

    Reads FSDP2's parameter groups (private attributes, read defensively: a Torch
    release that renames them skips the check rather than failing).

    Raises:
        ValueError: a mixed-precision policy, or a non-default gradient divide factor.
    """
    from torch.distributed.fsdp import FSDPModule

    for name, module in target.named_modules():
        sharded = isinstance(module, FSDPModule)  # a bool: keeps ``module`` an nn.Module
        if not sharded:
            continue
        label = name or "the root module"
        dtypes = {parameter.dtype for parameter in module.parameters(recurse=False)} or {
            parameter.dtype for parameter in module.parameters()
        }
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", []):
            policy = getattr(group, "mp_policy", None)
            for field in ("param_dtype", "reduce_dtype"):
                dtype = getattr(policy, field, None)
                if dtype is not None and dtype not in dtypes:
                    raise ValueError(FSDP_PRECISION.format(policy=f"{field}={dtype}", module=label))
            factor = getattr(group, "gradient_divide_factor", None)
            if factor is not None and factor != world:
                raise ValueError(FSDP_DIVIDE.format(module=label, factor=factor))


def _fsdp_mesh(
    target: nn.Module,
    named_parameters: tuple[tuple[str, nn.Parameter], ...],
) -> dict[str, Any]:
    """The device mesh and placements of an FSDP2 model (checked: all shards, one mesh).

    Raises:
        ValueError: a parameter is not sharded, the mesh does not span every process,
            or an FSDP2 policy changes the update (:func:`_check_fsdp_policies`).
    """
    import torch.distributed as distributed

    plain = [name for name, parameter in named_parameters if not isinstance(parameter, DTensor)]
    if plain:
        raise ValueError(FSDP_PARTIAL.format(names=", ".join(plain)))
    world = distributed.get_world_size() if distributed.is_initialized() else 1
    meshes = set()
    placements = set()
    for name, parameter in named_parameters:
        assert isinstance(parameter, DTensor)
        mesh = parameter.device_mesh
        if mesh.size() != world:
            raise ValueError(FSDP_SUBMESH.format(world=world, name=name, size=mesh.size()))
        meshes.add(tuple(mesh.shape))
        placements.add(tuple(str(placement) for placement in parameter.placements))
    _check_fsdp_policies(target, world)
    return {
        "world_size": world,
        "mesh": [list(shape) for shape in sorted(meshes)],
        "placements": [list(entry) for entry in sorted(placements)],
    }


@dataclass(frozen=True)
class PreparedModel:
    """Bind one eager module to a stable parameter and buffer layout.

    Attributes:
        public: the object the user holds and calls (possibly a DDP wrapper).
        target: the module whose parameters and buffers are committed.
        parameter_names: committed parameter leaf paths, in order.
        buffer_names: committed buffer leaf paths, in order.
        distributed: the public object is a DDP wrapper.
        fsdp: the module is sharded by FSDP2; the full parameters are committed.
        mesh: under FSDP2, the world size, device-mesh shapes and placements.
        functional: the module ``torch.func.functional_call`` runs: ``target``, or under
            FSDP2 its hook-free :func:`plain_structure`.
        parameter_metadata: ``(shape, dtype, device)`` of every parameter (full shapes).
        state_parameters: the live parameters, in order.
        state_buffers: the live buffers, in order.
    """

    public: nn.Module
    target: nn.Module
    parameter_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    distributed: bool
    fsdp: bool
    mesh: dict[str, Any] | None
    functional: nn.Module
    parameter_metadata: tuple[Any, ...]
    state_parameters: tuple[torch.Tensor, ...]
    state_buffers: tuple[torch.Tensor, ...]

    @classmethod
    def bind(cls, module: nn.Module) -> PreparedModel:
        """Fix the layout of ``module``'s state.

        Raises:
            ValueError: the module has no parameters, or is only partly sharded by
                FSDP2, or sharded over a mesh smaller than the world.
        """
        target, distributed = unwrap(module)
        named_parameters = tuple(target.named_parameters())
        if not named_parameters:
            raise ValueError("proof.prepare() needs a model with at least one parameter")
        named_buffers = tuple(target.named_buffers())
        fsdp = _is_fsdp(target)
        mesh = _fsdp_mesh(target, named_parameters) if fsdp else None
        return cls(
            public=module,
            target=target,
            parameter_names=tuple(name for name, _ in named_parameters),
            buffer_names=tuple(name for name, _ in named_buffers),
            distributed=distributed,
            fsdp=fsdp,
            mesh=mesh,
            functional=plain_structure(target) if fsdp else target,
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

    def full_parameters(self) -> tuple[torch.Tensor, ...]:
        """The whole parameters: under FSDP2 all-gathered (a collective on every rank)."""
        if not self.fsdp:
            return self.parameters
        return tuple(full(parameter) for parameter in self.state_parameters)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The live buffers, in layout order.

        Re-read from the module: a module may rebind a buffer attribute.
        """
        named = dict(self.target.named_buffers())
        return tuple(_local(named[name]).detach() for name in self.buffer_names)

    @contextlib.contextmanager
    def substituted(
        self, model_state: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
    ) -> Iterator[None]:
        """``model_state`` in place of the module's own state until the block ends.

        The attested step is traced inside this block, so the substitution lasts through
        the backward pass too: activation checkpointing (``torch.utils.checkpoint``)
        recomputes forward parts there, and must see the traced parameters, not the live
        ones. Inside, ``model.parameters()`` yields the traced parameters.
        """
        parameters, buffers = model_state
        if self.fsdp:
            refresh_structure(self.target, self.functional)
        state = dict(zip(self.parameter_names, parameters, strict=True))
        state.update(zip(self.buffer_names, buffers, strict=True))
        with _reparametrize_module(self.functional, state, tie_weights=True, strict=False):
            yield

    def call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """Call the module inside :meth:`substituted` (the traced state is in place)."""
        if self.fsdp:
            refresh_structure(self.target, self.functional)
        return self.functional(*args, **kwargs)

    def forward(
        self,
        model_state: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """Call the module with ``model_state`` substituted for its own state."""
        parameters, buffers = model_state
        if self.fsdp:
            refresh_structure(self.target, self.functional)
        state = dict(zip(self.parameter_names, parameters, strict=True))
        state.update(zip(self.buffer_names, buffers, strict=True))
        return torch.func.functional_call(
            self.functional, state, tuple(args), dict(kwargs), tie_weights=True, strict=False
        )
