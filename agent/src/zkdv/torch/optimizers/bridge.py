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
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zkdv.torch.model import full
from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.buffers import pack_optimizer_state

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

    Args:
        optimizer: the user's eager optimizer; its lazily created state is created
            now through ``contract.initialize`` so the layout is fixed from step 0.
        contract: the functional contract of ``type(optimizer)``.

    Raises:
        ValueError: the contract rejects the optimizer's configuration.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, contract: OptimizerContract) -> None:
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
        self._configuration = self._current_configuration()
        # The attested options, frozen: a replay runs on another thread, possibly after
        # the caller changed a group (which the next step then rejects).
        self._groups = tuple(
            {name: copy.deepcopy(value) for name, value in group.items() if name != "params"}
            for group in optimizer.param_groups
        )
        self._initialize()
        pack_optimizer_state(optimizer)
        self.state_names: tuple[tuple[str, ...], ...] = tuple(
            tuple(sorted(optimizer.state[parameter])) for parameter in self.parameters
        )
        self._order: tuple[torch.Tensor, ...] = self.parameters

    # --- layout -------------------------------------------------------------------------
    def bind(self, parameters: tuple[torch.Tensor, ...]) -> None:
        """Bind optimizer groups to a model's canonical parameter order.

        Raises:
            ValueError: the optimizer does not hold exactly the model's parameters.
        """
        positions = {id(parameter): index for index, parameter in enumerate(parameters)}
        if len(positions) != len(parameters) or set(positions) != {
            id(parameter) for parameter in self.parameters
        }:
            raise ValueError("prepared optimizer parameters must exactly cover the prepared model")
        self._group_positions = tuple(
            tuple(positions[id(parameter)] for parameter in group["params"])
            for group in self.optimizer.param_groups
        )
        self._order = tuple(parameters)
        self.state_names = tuple(
            tuple(sorted(self.optimizer.state[parameter])) for parameter in parameters
        )

    def validate_configuration(self) -> None:
        """Reject optimizer semantics that changed after attestation.

        Raises:
            RuntimeError: an option, or the parameter grouping, changed.
        """
        if self._current_configuration() != self._configuration:
            raise RuntimeError(OPTIONS_CHANGED)

    def options(self) -> list[dict[str, Any]]:
        """Every group's static options (JSON-able), for the transcript's root record."""
        return [self.contract.options(group) for group in self.optimizer.param_groups]

    def _current_configuration(self) -> tuple[Any, ...]:
        return tuple(
            (tuple(id(parameter) for parameter in group["params"]), self.contract.options(group))
            for group in self.optimizer.param_groups
        )

    def _initialize(self) -> None:
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                state = self.optimizer.state[parameter]
                if not state:
                    state.update(self.contract.initialize(parameter.detach(), group))

    # --- state --------------------------------------------------------------------------
    def pack_state(self) -> tuple[tuple[dict[str, Any], ...], ...]:
        """Return the live optimizer state per group without copying its tensors."""
        return tuple(
            tuple(
                {name: _local(value) for name, value in self.optimizer.state[parameter].items()}
                for parameter in group["params"]
            )
            for group in self.optimizer.param_groups
        )

    def live_states(self) -> list[State]:
        """The live state of every parameter in canonical (model) order, uncopied."""
        return [
            {name: _local(value) for name, value in self.optimizer.state[parameter].items()}
            for parameter in self._order
        ]

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
            for parameter in self._order
        ]

    def leaf_paths(self, names: Sequence[str]) -> list[str]:
        """Committed leaf paths, given the model's parameter names in canonical order."""
        return [
            f"{name}.{entry}"
            for name, entries in zip(names, self.state_names, strict=True)
            for entry in entries
        ]

    def leaves(
        self, states: Sequence[State], parameters: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Committed leaf tensors of per-parameter ``states`` in canonical order."""
        out: list[torch.Tensor] = []
        for entries, state, parameter in zip(self.state_names, states, parameters, strict=True):
            for entry in entries:
                out.append(_as_leaf(state.get(entry), parameter))
        return out

    def clone_states(self, states: Sequence[State]) -> list[State]:
        return [clone_state(state) for state in states]

    # --- functional transition ----------------------------------------------------------
    def step(
        self,
        parameters: Sequence[torch.Tensor],
        states: Sequence[State],
        gradients: Sequence[torch.Tensor | None],
    ) -> tuple[list[torch.Tensor], list[State]]:
        """One functional optimizer step on copies; the inputs are left unchanged.

        Args:
            parameters: pre-update parameters in canonical order.
            states: their optimizer states in canonical order.
            gradients: their gradients; ``None`` skips a parameter as torch.optim does.

        Returns:
            ``(parameters after, states after)``, both in canonical order.
        """
        updated = [parameter.detach().clone() for parameter in parameters]
        updated_states = [clone_state(state) for state in states]
        with torch.no_grad():
            for group, positions in zip(self._groups, self._group_positions, strict=True):
                active = [position for position in positions if gradients[position] is not None]
                if not active:
                    continue
                self.contract.update(
                    [updated[position] for position in active],
                    [gradients[position] for position in active],  # type: ignore[misc]
                    [updated_states[position] for position in active],
                    group,
                )
        return updated, updated_states

    def transition(
        self,
        parameters: tuple[torch.Tensor, ...],
        state: tuple[tuple[dict[str, Any], ...], ...],
        gradients: tuple[torch.Tensor | None, ...],
    ) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[dict[str, Any], ...], ...]]:
        """Compute deltas and next optimizer state without changing the inputs.

        ``state`` is grouped as :meth:`pack_state` returns it; ``parameters`` and
        ``gradients`` are in canonical order.
        """
        flat: list[State] = [{} for _ in parameters]
        for positions, group_state in zip(self._group_positions, state, strict=True):
            for position, entry in zip(positions, group_state, strict=True):
                flat[position] = entry
        after, states_after = self.step(parameters, flat, gradients)
        deltas = tuple(a - b for a, b in zip(after, parameters, strict=True))
        grouped = tuple(
            tuple(states_after[position] for position in positions)
            for positions in self._group_positions
        )
        return deltas, grouped


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
