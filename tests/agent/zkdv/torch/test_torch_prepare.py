"""proof.prepare(): what it recognises, what it passes through, what it rejects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zkdv
from zkdv.torch._prepared import PreparedOptimizer
from zkdv.torch.optimizers import OptimizerContract
from zkdv.torch.optimizers.sgd import SGDContract
from zkdv.verify import verify_transcript


@pytest.fixture
def proof(tmp_path: Path):
    proof = zkdv.torch.ZKDV(tmp_path / "proof")
    proof.start(rolling_window=2)
    yield proof
    proof.close()


def test_prepare_returns_the_sole_value_or_a_tuple(proof) -> None:
    model = nn.Linear(3, 2)
    assert proof.prepare(model) is model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tensor, config = torch.ones(2), {"lr": 0.1}
    prepared_model, prepared_optimizer, same_tensor, same_config, nothing = proof.prepare(
        model, optimizer, tensor, config, None
    )
    assert prepared_model is model
    assert isinstance(prepared_optimizer, PreparedOptimizer)
    assert prepared_optimizer.optimizer is optimizer
    assert prepared_optimizer.param_groups is optimizer.param_groups
    assert (same_tensor, same_config, nothing) == (tensor, config, None)
    # Preparing again is idempotent.
    assert proof.prepare(prepared_optimizer) is prepared_optimizer
    assert proof.prepare(optimizer) is prepared_optimizer
    activation = nn.ReLU()
    assert proof.prepare(activation) is activation  # stateless modules pass through


def test_prepared_model_layout_is_stable(proof) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    proof.prepare(model)
    prepared = proof._require_prepared_model()
    assert prepared.parameter_names == (
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.bias",
    )
    assert prepared.buffer_names == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    with pytest.raises(ValueError, match="one root model per proof"):
        proof.prepare(nn.Linear(2, 2))


def test_optimizer_state_is_created_with_torch_layout(proof) -> None:
    model = nn.Linear(3, 2)
    _, optimizer = proof.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    state = optimizer.state[model.weight]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert state["step"].device.type == "cpu" and float(state["step"]) == 0.0


def test_lbfgs_is_rejected_with_the_registration_instruction(proof) -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"register_functional_optimizer\(torch.optim.LBFGS"):
        proof.prepare(torch.optim.LBFGS(model.parameters()))


def test_unknown_subclasses_are_rejected_until_registered(proof) -> None:
    class MySGD(torch.optim.SGD):
        pass

    model = nn.Linear(3, 2)
    optimizer = MySGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"call proof\.register_functional_optimizer\(.*MySGD"):
        proof.prepare(optimizer)
    proof.register_functional_optimizer(MySGD, SGDContract())
    assert isinstance(proof.prepare(optimizer), PreparedOptimizer)


def test_a_custom_contract_can_be_registered(tmp_path: Path) -> None:
    class SignDescent(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])

    class SignDescentContract(OptimizerContract):
        optimizer_type = SignDescent

        def initialize(self, parameter: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
            return {}

        def update(self, parameters, gradients, states, group) -> None:
            for parameter, gradient in zip(parameters, gradients, strict=True):
                parameter.add_(gradient.sign(), alpha=-group["lr"])

    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
    proof = zkdv.torch.ZKDV(tmp_path / "proof", config)
    proof.start(rolling_window=2)
    proof.register_functional_optimizer(SignDescent, SignDescentContract())
    model = nn.Linear(3, 1)
    model, optimizer = proof.prepare(model, SignDescent(model.parameters(), lr=0.01))

    @proof.attest
    def step(model, optimizer, batch):
        proof.backward(nn.functional.mse_loss(proof.forward(model, batch[0]), batch[1]))
        optimizer.step()

    for _ in range(3):
        batch = (torch.randn(4, 3), torch.randn(4, 1))
        with proof.transaction(batch=batch):
            optimizer.zero_grad()
            proof.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
            optimizer.step()
    proof.close()
    assert verify_transcript(tmp_path / "proof").ok


def test_differentiable_steps_are_rejected(proof) -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    with pytest.raises(ValueError, match="does not support differentiable optimizer steps"):
        proof.prepare(optimizer)


def test_tensor_valued_options_are_rejected(proof) -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match=r"requires static optimizer options, but \('lr',\)"):
        proof.prepare(optimizer)


def test_an_optimizer_over_other_parameters_is_rejected(proof) -> None:
    with pytest.raises(
        ValueError, match="holds tensors that are not parameters of the prepared model"
    ):
        proof.prepare(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1))


def test_the_driver_imports_in_any_order(tmp_path: Path) -> None:
    import sys

    from tests.processes import start, wait_all

    statements = (
        "from zkdv.torch._driver import ZKDV",
        "from zkdv.torch import ZKDV",
        "import zkdv; ZKDV = zkdv.torch.ZKDV",
    )
    # Fresh interpreters, started together: each import order needs its own process.
    runs = [
        start(
            [sys.executable, "-c", f"{s}; import zkdv.torch._driver as d; assert ZKDV is d.ZKDV"],
            folder=tmp_path,
            name=f"order-{number}",
        )
        for number, s in enumerate(statements)
    ]
    wait_all(runs, timeout=120)
    for statement, run in zip(statements, runs, strict=True):
        assert run.returncode == 0, f"{statement}: {run.tail()}"
