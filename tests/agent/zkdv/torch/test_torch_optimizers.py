"""Every functional optimizer contract equals torch.optim's own step.

For each of the 14 supported optimizers, two identical models train side by side for
several steps with two parameter groups and non-default options: one with the native
``optimizer.step()``, the other only through the contract's functional transition
(:meth:`OptimizerBridge.step`), starting from the state the bridge creates eagerly.
Parameters and every optimizer-state entry must be bitwise equal: the contracts call
the same functional cores ``step()`` calls, on CPU with the same (single-tensor)
implementation, so there is no tolerance to state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from zkdv.torch.optimizers import OptimizerBridge, OptimizerRegistry

STEPS = 6


def _mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias))


def _groups(model: nn.Module, first: dict[str, Any], second: dict[str, Any]) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), **first},
        {"params": list(model[2].parameters()), **second},
    ]


CASES: dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], bool]] = {
    "ASGD": (
        lambda m: torch.optim.ASGD(
            _groups(m, {"lr": 0.05}, {"lambd": 1e-3, "t0": 2.0}), alpha=0.8, weight_decay=0.01
        ),
        True,
    ),
    "Adadelta": (
        lambda m: torch.optim.Adadelta(
            _groups(m, {"lr": 0.5}, {"lr": 1.0, "eps": 1e-5}), rho=0.8, weight_decay=0.01
        ),
        True,
    ),
    "Adafactor": (
        lambda m: torch.optim.Adafactor(
            _groups(m, {"lr": 0.02}, {"lr": 0.05, "maximize": True}),
            beta2_decay=-0.7,
            weight_decay=0.01,
        ),
        True,
    ),
    "Adagrad": (
        lambda m: torch.optim.Adagrad(
            _groups(m, {"lr": 0.1}, {"lr": 0.05, "eps": 1e-8}),
            lr_decay=0.01,
            initial_accumulator_value=0.1,
            weight_decay=0.01,
        ),
        True,
    ),
    "Adam": (
        lambda m: torch.optim.Adam(
            _groups(m, {"lr": 1e-2}, {"lr": 5e-3, "maximize": True}),
            betas=(0.8, 0.99),
            amsgrad=True,
            weight_decay=0.01,
        ),
        True,
    ),
    "AdamW": (
        lambda m: torch.optim.AdamW(
            _groups(m, {"lr": 1e-2}, {"lr": 2e-2, "amsgrad": True}), weight_decay=0.1
        ),
        True,
    ),
    "Adamax": (
        lambda m: torch.optim.Adamax(
            _groups(m, {"lr": 2e-2}, {"lr": 1e-2, "betas": (0.7, 0.9)}),
            betas=(0.8, 0.95),
            weight_decay=0.01,
        ),
        True,
    ),
    "Muon": (
        lambda m: torch.optim.Muon(
            _groups(m, {"lr": 0.02}, {"adjust_lr_fn": "match_rms_adamw", "ns_steps": 3}),
            momentum=0.9,
            nesterov=False,
            weight_decay=0.05,
        ),
        False,
    ),
    "NAdam": (
        lambda m: torch.optim.NAdam(
            _groups(m, {"lr": 1e-2}, {"lr": 2e-2, "decoupled_weight_decay": True}),
            momentum_decay=3e-3,
            weight_decay=0.01,
        ),
        True,
    ),
    "RAdam": (
        lambda m: torch.optim.RAdam(
            _groups(m, {"lr": 1e-2}, {"lr": 2e-2, "decoupled_weight_decay": True}),
            betas=(0.8, 0.9),
            weight_decay=0.01,
        ),
        True,
    ),
    "RMSprop": (
        lambda m: torch.optim.RMSprop(
            _groups(m, {"momentum": 0.5, "centered": True}, {"lr": 2e-2}),
            lr=1e-2,
            alpha=0.9,
            weight_decay=0.01,
        ),
        True,
    ),
    "Rprop": (
        lambda m: torch.optim.Rprop(
            _groups(m, {"lr": 1e-2}, {"lr": 2e-2, "maximize": True}),
            etas=(0.4, 1.3),
            step_sizes=(1e-5, 1.0),
        ),
        True,
    ),
    "SGD": (
        lambda m: torch.optim.SGD(
            _groups(
                m,
                {"momentum": 0.9, "dampening": 0.1},
                {"momentum": 0.8, "nesterov": True, "lr": 0.05},
            ),
            lr=0.1,
            weight_decay=0.01,
        ),
        True,
    ),
}


def _gradients(model: nn.Module, names: list[str], parameters: list[torch.Tensor], batch):
    inputs, targets = batch
    leaves = [parameter.detach().requires_grad_(True) for parameter in parameters]
    outputs = torch.func.functional_call(model, dict(zip(names, leaves, strict=True)), (inputs,))
    loss = nn.functional.mse_loss(outputs, targets)
    return list(torch.autograd.grad(loss, leaves))


def _assert_state_equal(native: dict[str, Any], functional: dict[str, Any], where: str) -> None:
    assert set(native) == set(functional), where
    for name, value in native.items():
        other = functional[name]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{where}.{name}"
        else:
            assert value == other, f"{where}.{name}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_functional_transition_equals_torch_optim(name: str) -> None:
    make, bias = CASES[name]
    native_model = _mlp(bias)
    functional_model = copy.deepcopy(native_model)
    native = make(native_model)
    reference = make(functional_model)
    # The contract's own update (torch.optim's functional core); the canonical update
    # rounds on purpose otherwise (tests/agent/zkdv/torch/test_canonical_optimizers.py).
    bridge = OptimizerBridge(reference, OptimizerRegistry().resolve(reference), canonical=False)
    names = [n for n, _ in functional_model.named_parameters()]
    parameters = [p.detach().clone() for p in functional_model.parameters()]
    bridge.bind(tuple(functional_model.parameters()))
    states = bridge.clone_states(bridge.live_states())
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        batch = (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
        native.zero_grad()
        nn.functional.mse_loss(native_model(batch[0]), batch[1]).backward()
        native.step()
        gradients = _gradients(functional_model, names, parameters, batch)
        parameters, states = bridge.step(parameters, states, gradients)
        for index, (live, replayed) in enumerate(
            zip(native_model.parameters(), parameters, strict=True)
        ):
            assert torch.equal(live.detach(), replayed), f"{name} step {step} parameter {index}"
    for index, parameter in enumerate(native_model.parameters()):
        _assert_state_equal(native.state[parameter], states[index], f"{name} parameter {index}")


def test_sparse_adam_transition_equals_torch_optim() -> None:
    native_model = nn.ModuleList([nn.Embedding(7, 4, sparse=True) for _ in range(2)])
    functional_model = copy.deepcopy(native_model)

    def make(model: nn.ModuleList) -> torch.optim.Optimizer:
        return torch.optim.SparseAdam(
            [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 3e-2}],
            lr=1e-2,
            betas=(0.8, 0.99),
        )

    native, reference = make(native_model), make(functional_model)
    bridge = OptimizerBridge(reference, OptimizerRegistry().resolve(reference))
    bridge.bind(tuple(functional_model.parameters()))
    parameters = [p.detach().clone() for p in functional_model.parameters()]
    states = bridge.clone_states(bridge.live_states())
    generator = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        tokens = torch.randint(7, (5,), generator=generator)
        native.zero_grad()
        sum((embedding(tokens) ** 2).sum() for embedding in native_model).backward()
        native.step()
        leaves = [p.detach().requires_grad_(True) for p in parameters]
        loss = sum((nn.functional.embedding(tokens, w, sparse=True) ** 2).sum() for w in leaves)
        gradients = list(torch.autograd.grad(loss, leaves))
        assert all(gradient.is_sparse for gradient in gradients)
        parameters, states = bridge.step(parameters, states, gradients)
    for index, parameter in enumerate(native_model.parameters()):
        assert torch.equal(parameter.detach(), parameters[index])
        _assert_state_equal(native.state[parameter], states[index], f"SparseAdam {index}")


def test_the_fourteen_contracts_are_registered() -> None:
    registry = OptimizerRegistry()
    supported = {*CASES, "SparseAdam"}
    assert len(supported) == 14
    for name in supported:
        assert getattr(torch.optim, name) in registry
