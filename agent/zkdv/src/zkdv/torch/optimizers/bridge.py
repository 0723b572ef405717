"""State-preserving bridge from eager optimizers to functional contracts.

The bridge fixes the optimizer state's canonical layout: parameters in the prepared
model's order, each parameter's state entries in sorted name order, one committed leaf
per entry (``"<parameter name>.<entry>"``). Flat optimizer-state indices of a sampled
check count coordinates over these leaves in that order. An absent entry (SGD's
momentum buffer before its first step) is committed as zeros; a Python number
(SparseAdam's ``step``) as a 0-d int64 or float64 leaf.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zkdv.torch._model import full
from zkdv.torch.optimizers import canonical as canonical_update
from zkdv.torch.optimizers.base import TENSOR_OPTIONS_UNSUPPORTED, OptimizerContract
from zkdv.torch.optimizers.buffers import pack_optimizer_state

SCALER = "grad_scaler"
SCALER_ENTRIES = ("growth_tracker", "scale")

__all__ = ["OPTIONS_CHANGED", "OptimizerBridge", "clone_state"]

OPTIONS_CHANGED = (
    "prepared optimizer options changed after attestation; create a "
    "new proof for the new optimizer schedule"
)

State = dict[str, Any]


def clone_state(state: State) -> State:
    """A deep copy of one parameter's state: tensors cloned, other values kept."""
    return {
        name: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for name, value in state.items()
    }


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class OptimizerBridge:
    """Own the canonical state layout for one prepared optimizer.

    Options fall in two kinds. A *dynamic* option is a number or a tuple of numbers
    (``lr``, ``betas``, ``momentum``, ``weight_decay``, ...): what a learning-rate or
    momentum scheduler writes between steps. Its value at each step is an input of that
    step's transition, read by :meth:`hyperparameters` when ``optimizer.step()`` runs,
    committed in the step record (``hp``) and used by every replay. Everything else
    (flags such as ``amsgrad``, ``nesterov`` or ``foreach``, which parameters each group
    holds) is *static*: fixed at attestation, and a change is refused
    (:data:`OPTIONS_CHANGED`). Only the keys of the optimizer's ``defaults`` are
    options; keys a scheduler adds to a group for its own bookkeeping (``initial_lr``,
    ``max_lr``, ``base_momentum``, ...) are not.

    The update itself is *canonical* where :mod:`zkdv.torch.optimizers.canonical`
    covers the optimizer (Adam, AdamW, SGD, ...: :attr:`canonical_reason` is None): a
    fixed sequence of correctly rounded operations that gives the same bits on any
    hardware, applied by training (:meth:`update_live`), by the SDK's sampled checks and
    by the platform's replay (:meth:`step`) alike. Otherwise it is the contract's
    ``torch.optim`` functional core, which rounds differently on other CPU kernel
    families and GPUs.

    Args:
        optimizer: the user's eager optimizer; its lazily created state is created
            now through ``contract.initialize`` so the layout is fixed from step 0.
        contract: the functional contract of ``type(optimizer)``.
        canonical: use the canonical update (True), the contract's (False), or decide
            by what the canonical update covers (None). A replay passes what the run
            recorded.

    Raises:
        ValueError: the contract rejects the optimizer's configuration, or
            ``canonical=True`` where the canonical update does not cover it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        contract: OptimizerContract,
        *,
        canonical: bool | None = None,
    ) -> None:
        contract.validate(optimizer)
        self.optimizer = optimizer
        self.contract = contract
        self.parameters = tuple(
            parameter for group in optimizer.param_groups for parameter in group["params"]
        )
        if len({id(parameter) for parameter in self.parameters}) != len(self.parameters):
            raise ValueError("a parameter appears in more than one optimizer parameter group")
        start = 0
        positions = []
        for group in optimizer.param_groups:
            positions.append(tuple(range(start, start + len(group["params"]))))
            start += len(group["params"])
        self._group_positions = tuple(positions)
        #: Per group, the names of its dynamic options (fixed at attestation).
        self.dynamic: tuple[tuple[str, ...], ...] = tuple(
            tuple(name for name in sorted(self._option_names(group)) if _dynamic(group[name]))
            for group in optimizer.param_groups
        )
        self._configuration = self._current_configuration()
        # The attested options, frozen: a replay runs on another thread, possibly after
        # the caller changed a group. Dynamic options are overridden per step.
        self._groups = tuple(
            {name: copy.deepcopy(value) for name, value in group.items() if name != "params"}
            for group in optimizer.param_groups
        )
        self._initialize()
        pack_optimizer_state(optimizer)
        #: Why the canonical update does not cover this optimizer (None: it does).
        self.canonical_reason: str | None = (
            "the run recorded the optimizer's own update" if canonical is False else None
        )
        if canonical is not False:
            reason = self._canonical_reason(optimizer, contract)
            if reason is not None and canonical:
                raise ValueError(f"the canonical optimizer update does not apply: {reason}")
            self.canonical_reason = reason
        self.state_names: tuple[tuple[str, ...], ...] = tuple(
            tuple(sorted(optimizer.state[parameter])) for parameter in self.parameters
        )
        self._order: tuple[torch.Tensor, ...] = self.parameters
        self._held: tuple[bool, ...] = (True,) * len(self.parameters)
        #: A prepared GradScaler's live state (None: no loss scaling), and its options.
        self._scaler_state: Callable[[], State] | None = None
        self.scaler_options: dict[str, Any] | None = None

    @staticmethod
    def _canonical_reason(
        optimizer: torch.optim.Optimizer, contract: OptimizerContract
    ) -> str | None:
        kind = contract.optimizer_type
        builtin = type(contract).__module__.startswith("zkdv.torch.optimizers.")
        if not builtin or kind is None or type(optimizer) is not kind:
            return (
                f"{type(optimizer).__name__} has a custom contract; only torch.optim's own "
                "optimizers have a canonical update"
            )
        for group in optimizer.param_groups:
            reason = canonical_update.supports(
                contract.name, group, {parameter.dtype for parameter in group["params"]}
            )
            if reason is not None:
                return reason
        return None

    def use_native(self, reason: str) -> None:
        """Apply the contract's own update from now on (training does, for ``reason``)."""
        self.canonical_reason = reason

    @property
    def canonical(self) -> bool:
        """Whether the update is the canonical one (bitwise reproducible anywhere)."""
        return self.canonical_reason is None

    def bind_scaler(self, live: Callable[[], State] | None, options: dict[str, Any]) -> None:
        """Commit a GradScaler's state after every parameter's optimizer state.

        Args:
            live: returns the scaler's live state (``{"growth_tracker", "scale"}``), or
                None where there is no live scaler (a replay builds it from leaves).
            options: its growth and backoff options.
        """
        self._scaler_state = live or (lambda: {})
        self.scaler_options = dict(options)

    @property
    def scaled(self) -> bool:
        """Whether a GradScaler's state follows the parameters' states."""
        return self.scaler_options is not None

    # --- layout -------------------------------------------------------------------------
    def bind(self, parameters: tuple[torch.Tensor, ...]) -> None:
        """Bind optimizer groups to a model's canonical parameter order.

        The optimizer may hold a subset of the model's parameters (a fine-tune that
        trains adapters only): the others have no optimizer state and no update.

        Raises:
            ValueError: the optimizer holds a tensor that is not a model parameter.
        """
        positions = {id(parameter): index for index, parameter in enumerate(parameters)}
        strangers = [
            index
            for index, parameter in enumerate(self.parameters)
            if id(parameter) not in positions
        ]
        if len(positions) != len(parameters) or strangers:
            raise ValueError(
                "the prepared optimizer holds tensors that are not parameters of the prepared "
                "model; optimize only the prepared model's parameters"
            )
        self._group_positions = tuple(
            tuple(positions[id(parameter)] for parameter in group["params"])
            for group in self.optimizer.param_groups
        )
        self._order = tuple(parameters)
        held = {id(parameter) for parameter in self.parameters}
        self._held = tuple(id(parameter) in held for parameter in parameters)
        self.state_names = tuple(
            tuple(sorted(self.optimizer.state[parameter])) if id(parameter) in held else ()
            for parameter in parameters
        )

    @property
    def held(self) -> tuple[bool, ...]:
        """Per model parameter (canonical order), whether the optimizer updates it."""
        return self._held

    def validate_configuration(self) -> None:
        """Reject optimizer semantics that changed after attestation.

        Dynamic options may change between steps (schedulers), as long as they stay
        numbers of the same shape; everything else must not.

        Raises:
            RuntimeError: a static option, the parameter grouping, or the kind of a
                dynamic option changed.
        """
        for group, names in zip(self.optimizer.param_groups, self.dynamic, strict=True):
            tensors = tuple(name for name in names if _holds_tensor(group[name]))
            if tensors:
                raise RuntimeError(TENSOR_OPTIONS_UNSUPPORTED.format(names=tensors))
        if self._current_configuration() != self._configuration:
            raise RuntimeError(OPTIONS_CHANGED)
        for group, names in zip(self.optimizer.param_groups, self.dynamic, strict=True):
            for name in names:
                if not _finite(group[name]):
                    raise RuntimeError(
                        f"optimizer option {name}={group[name]!r} is not a finite number; "
                        "ZKDV commits every step's options as numbers"
                    )

    def options(self) -> list[dict[str, Any]]:
        """Every group's options at attestation (JSON-able), for the root record."""
        return [
            self.contract.options({name: group[name] for name in self._option_names(group)})
            for group in self.optimizer.param_groups
        ]

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Every group's dynamic options now: one step's ``hp`` (numbers and lists)."""
        return [
            {name: _number(group[name]) for name in names}
            for group, names in zip(self.optimizer.param_groups, self.dynamic, strict=True)
        ]

    def _option_names(self, group: dict[str, Any]) -> list[str]:
        known = self.optimizer.defaults
        return [name for name in group if name != "params" and name in known]

    def _current_configuration(self) -> tuple[Any, ...]:
        return tuple(
            (
                tuple(id(parameter) for parameter in group["params"]),
                self.contract.options(
                    {
                        name: group[name] if name not in dynamic else _shape(group[name])
                        for name in self._option_names(group)
                    }
                ),
            )
            for group, dynamic in zip(self.optimizer.param_groups, self.dynamic, strict=True)
        )

    def _initialize(self) -> None:
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                state = self.optimizer.state[parameter]
                if not state:
                    state.update(self.contract.initialize(parameter.detach(), group))

    # --- state --------------------------------------------------------------------------
    def live_states(self) -> list[State]:
        """The live state of every parameter in canonical (model) order, uncopied.

        A parameter the optimizer does not hold has an empty state.
        """
        states = [
            {name: _local(value) for name, value in self.optimizer.state[parameter].items()}
            if held
            else {}
            for parameter, held in zip(self._order, self._held, strict=True)
        ]
        if self._scaler_state is not None:
            states.append(self._scaler_state())
        return states

    def full_states(self) -> list[State]:
        """Every parameter's whole state in canonical order (FSDP2: a collective).

        Sharded (``DTensor``) entries are all-gathered, in canonical parameter order and
        sorted entry order, so every rank issues the same collectives in the same order.
        """
        return [
            {
                name: full(value) if isinstance(value, torch.Tensor) else value
                for name, value in sorted(self.optimizer.state[parameter].items())
            }
            if held
            else {}
            for parameter, held in zip(self._order, self._held, strict=True)
        ] + ([self._scaler_state()] if self._scaler_state is not None else [])

    def leaf_paths(self, names: Sequence[str]) -> list[str]:
        """Committed leaf paths, given the model's parameter names in canonical order."""
        paths = [
            f"{name}.{entry}"
            for name, entries in zip(names, self.state_names, strict=True)
            for entry in entries
        ]
        if self.scaled:
            paths += [f"{SCALER}.{entry}" for entry in SCALER_ENTRIES]
        return paths

    def leaves(
        self, states: Sequence[State], parameters: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Committed leaf tensors of per-parameter ``states`` in canonical order.

        With a GradScaler, ``states`` ends with its state, whose leaves come last.
        """
        per_parameter = states[: len(self.state_names)]
        out: list[torch.Tensor] = []
        for entries, state, parameter in zip(
            self.state_names, per_parameter, parameters, strict=True
        ):
            for entry in entries:
                out.append(_as_leaf(state.get(entry), parameter))
        if self.scaled:
            scaler = states[len(self.state_names)]
            out += [scaler[entry].detach() for entry in SCALER_ENTRIES]
        return out

    def clone_states(self, states: Sequence[State]) -> list[State]:
        return [clone_state(state) for state in states]

    # --- functional transition ----------------------------------------------------------
    def groups(self, hyperparameters: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The attested group options with one step's dynamic options applied.

        Raises:
            ValueError: ``hyperparameters`` does not match the groups' dynamic options.
        """
        if hyperparameters is None:
            return [dict(group) for group in self._groups]
        if len(hyperparameters) != len(self._groups):
            raise ValueError(
                f"a step's hyperparameters name {len(hyperparameters)} optimizer groups; "
                f"the optimizer has {len(self._groups)}"
            )
        out = []
        for index, (group, names, values) in enumerate(
            zip(self._groups, self.dynamic, hyperparameters, strict=True)
        ):
            if set(values) != set(names):
                raise ValueError(
                    f"a step's hyperparameters of optimizer group {index} name "
                    f"{sorted(values)}; the group's dynamic options are {sorted(names)}"
                )
            out.append({**group, **{name: _option(values[name]) for name in names}})
        return out

    def step(
        self,
        parameters: Sequence[torch.Tensor],
        states: Sequence[State],
        gradients: Sequence[torch.Tensor | None],
        hyperparameters: Sequence[dict[str, Any]] | None = None,
        *,
        scaler: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], list[State]]:
        """One functional optimizer step on copies; the inputs are left unchanged.

        Args:
            parameters: pre-update parameters in canonical order.
            states: their optimizer states in canonical order (then a GradScaler's).
            gradients: their gradients; ``None`` skips a parameter as torch.optim does.
            hyperparameters: the step's dynamic options (:meth:`hyperparameters`, as
                committed in its step record); None keeps the attested ones.
            scaler: with a GradScaler, the program's ``(found_inf, growth_tracker,
                scale)`` after the step: an overflow skips the update, as the scaler's
                step does, and the scaler's state becomes the one given.

        Returns:
            ``(parameters after, states after)``, both in canonical order.
        """
        updated = [parameter.detach().clone() for parameter in parameters]
        updated_states = [clone_state(state) for state in states]
        if self.scaled:
            if scaler is None:
                raise ValueError("a step with a GradScaler needs the program's scaler outputs")
            found_inf, growth_tracker, scale = scaler
            updated_states[-1] = {
                "growth_tracker": growth_tracker.detach().clone(),
                "scale": scale.detach().clone(),
            }
            if bool(found_inf.item()):  # the scaler skipped the optimizer step
                return updated, updated_states
        if self.canonical and self.scaled and not _all_finite(gradients):
            # The canonical rule for loss scaling: a non-finite gradient skips the update,
            # decided from the committed gradient itself (GradScaler's found_inf).
            return updated, updated_states
        self._apply(updated, updated_states, gradients, hyperparameters)
        return updated, updated_states

    def update_live(
        self,
        gradients: Sequence[torch.Tensor | None],
        hyperparameters: Sequence[dict[str, Any]] | None,
    ) -> None:
        """Apply one step's canonical update to the live parameters and optimizer state.

        What training runs instead of ``torch.optim``'s native step, so the committed
        post-update state is what :meth:`step` recomputes from the committed gradient on
        any hardware.

        Args:
            gradients: per model parameter (canonical order), the gradient the update
                reads, or None (no update).
            hyperparameters: the step's dynamic options, as committed.
        """
        assert self.canonical, self.canonical_reason
        if self.scaled and not _all_finite(gradients):
            return
        states = [
            self.optimizer.state[parameter] if held else {}
            for parameter, held in zip(self._order, self._held, strict=True)
        ]
        self._apply(list(self._order), states, gradients, hyperparameters)

    def update_shards(
        self, trained: Sequence[bool], hyperparameters: Sequence[dict[str, Any]] | None
    ) -> None:
        """FSDP2: apply one step's canonical update to this rank's shards, in place.

        Each trained parameter is updated from its live gradient's shard, with the
        shards of its optimizer state. Every canonical update is elementwise, so each
        coordinate's bits are those of :meth:`step` on the full parameter, state and
        gathered gradient: what the platform's replay computes in one process.

        Args:
            trained: per model parameter (canonical order), whether its gradient is
                committed and updates it (all ranks alike).
            hyperparameters: the step's dynamic options, as committed.
        """
        assert self.canonical, self.canonical_reason
        assert not self.scaled, "a GradScaler is refused under FSDP2"
        live = [
            self.optimizer.state[parameter] if held else {}
            for parameter, held in zip(self._order, self._held, strict=True)
        ]
        with torch.no_grad():  # the local tensors themselves, not autograd views
            parameters = [_local(parameter) for parameter in self._order]
            gradients: list[torch.Tensor | None] = [
                _local(parameter.grad) if train and parameter.grad is not None else None
                for parameter, train in zip(self._order, trained, strict=True)
            ]
            shards = [{name: _local(value) for name, value in state.items()} for state in live]
            before = [dict(state) for state in shards]
            self._apply(parameters, shards, gradients, hyperparameters)
        for parameter, state, shard, old in zip(self._order, live, shards, before, strict=True):
            for name, value in shard.items():
                if value is not old.get(name):
                    # An entry the update created (SGD's first momentum buffer).
                    state[name] = _sharded_like(value, parameter)

    def _apply(
        self,
        parameters: Sequence[torch.Tensor],
        states: Sequence[State],
        gradients: Sequence[torch.Tensor | None],
        hyperparameters: Sequence[dict[str, Any]] | None,
    ) -> None:
        """One update of ``parameters`` and ``states`` in place, group by group."""
        with torch.no_grad():
            for group, positions in zip(
                self.groups(hyperparameters), self._group_positions, strict=True
            ):
                active = [position for position in positions if gradients[position] is not None]
                if not active:
                    continue
                arguments = (
                    [parameters[position] for position in active],
                    [gradients[position] for position in active],
                    [states[position] for position in active],
                    group,
                )
                if self.canonical:
                    canonical_update.update(self.contract.name, *arguments)
                else:
                    self.contract.update(*arguments)  # type: ignore[arg-type]


def _sharded_like(value: Any, parameter: torch.Tensor) -> Any:
    """``value``, a new shard of a state entry, as a DTensor laid out like ``parameter``."""
    if not isinstance(parameter, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != parameter.to_local().shape:
        return value  # a scalar entry (``step``) is not sharded
    return DTensor.from_local(
        value,
        parameter.device_mesh,
        parameter.placements,
        run_check=False,
        shape=parameter.shape,
        stride=parameter.stride(),
    )


def _all_finite(gradients: Sequence[torch.Tensor | None]) -> bool:
    """Whether every gradient is finite (one device-to-host read for all of them)."""
    present = [gradient for gradient in gradients if gradient is not None]
    if not present:
        return True
    flags = torch.stack([torch.isfinite(gradient).all() for gradient in present])
    return bool(flags.all().item())


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dynamic(value: Any) -> bool:
    """A number, or a non-empty tuple of numbers: what a scheduler may change."""
    if _real(value):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(_real(v) for v in value)


def _shape(value: Any) -> Any:
    """What must stay fixed of a dynamic option: a number, or a tuple of its length."""
    if isinstance(value, (tuple, list)):
        return ("tuple", len(value))
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "number" if _real(value) else repr(value)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _finite(value: Any) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return all(_real(v) and math.isfinite(v) for v in values)


def _number(value: Any) -> Any:
    """A dynamic option as committed: a number, or a list of numbers."""
    if isinstance(value, (tuple, list)):
        return [_number(v) for v in value]
    return int(value) if isinstance(value, int) else float(value)


def _option(value: Any) -> Any:
    """A committed dynamic option as the optimizer reads it (lists back to tuples)."""
    if isinstance(value, (tuple, list)):
        return tuple(_option(v) for v in value)
    if not _real(value):
        raise ValueError(f"a committed optimizer option must be a number, got {value!r}")
    return value


def _as_leaf(value: Any, parameter: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if value is None:
        # An absent buffer (SGD momentum before the first step) is committed as zeros.
        return torch.zeros_like(parameter, device="cpu")
    if isinstance(value, bool):
        return torch.tensor(int(value), dtype=torch.int64)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    raise TypeError(f"optimizer state value {value!r} cannot be committed")
