"""The ZKDV README's Torch quick start and the Torch reference's documented behaviour.

The quick start runs as written where CUDA is, and with the same calls on the CPU
everywhere (only the device differs). ``prepare`` returns what the README says it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zkdv
from zkdv.records import iter_records
from zkdv.verify import verify_transcript

torch = pytest.importorskip("torch")
nn = torch.nn
functional = torch.nn.functional


def _quick_start(device: str) -> Any:
    """The README's Torch quick start, on ``device`` (the README's is ``"cuda"``)."""
    proof = zkdv.torch.ZKDV("proof")
    proof.start(rolling_window=32, probe_ratio=0.01)
    model = nn.Linear(10, 2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def attested_step(model: Any, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        loss = functional.cross_entropy(proof.forward(model, inputs), targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    data = [
        (
            torch.randn(8, 10, device=device),
            torch.randint(2, (8,), device=device),
        )
    ]
    for inputs, targets in data:
        with proof.transaction(batch=(inputs, targets)):
            loss = functional.cross_entropy(model(inputs), targets)
            proof.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    proof.close()
    return proof


def _check_transcript() -> None:
    report = verify_transcript(Path("proof"))
    assert report.ok, report.summary()
    assert report.steps == 1
    root = next(iter(iter_records(Path("proof") / "records.cborl"))).data
    assert root["prover"] == "whitebox-torch"
    assert root["config"]["rolling_window"] == 32


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the README's Torch quick start puts the model and batch on CUDA (.cuda(), "
    "device='cuda'); this machine has no CUDA device, and the CPU test runs the same calls",
)
def test_the_torch_quick_start_as_written() -> None:
    _quick_start("cuda")
    _check_transcript()


def test_the_torch_quick_start_on_the_cpu() -> None:
    _quick_start("cpu")
    _check_transcript()


def test_prepare_returns_what_the_readme_says() -> None:
    proof = zkdv.torch.ZKDV("proof")
    proof.start(rolling_window=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"epochs": 2}
    # One argument: the value itself; several: a tuple; unrecognised values unchanged.
    prepared_model = proof.prepare(model)
    assert isinstance(prepared_model, nn.Module)
    prepared = proof.prepare(optimizer, settings, 3)
    assert isinstance(prepared, tuple) and len(prepared) == 3
    assert isinstance(prepared[0], torch.optim.Optimizer)
    assert prepared[1] is settings and prepared[2] == 3
    proof.close()


def test_lbfgs_and_unknown_subclasses_are_refused_with_the_register_instruction() -> None:
    proof = zkdv.torch.ZKDV("proof")
    proof.start(rolling_window=2)
    model = nn.Linear(3, 1)

    class Custom(torch.optim.SGD):
        pass

    with pytest.raises(
        ValueError, match=r"call proof\.register_functional_optimizer\(torch\.optim\.LBFGS"
    ):
        proof.prepare(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(
        ValueError, match=r"call proof\.register_functional_optimizer\(.*Custom, contract\)"
    ):
        proof.prepare(model, Custom(model.parameters(), lr=0.1))
    proof.close()
