"""Lowering the attested step: what is rejected, with the instruction it gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from provers import torch_replay
from zkdv.verify import verify_transcript

# Every step is re-executed and compared, so a step that trains something other than
# the attested function fails here, not only when the run's bits happen to draw a check.
EVERY_STEP = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=1.0))


def _run(tmp_path: Path, model: nn.Module, attested) -> None:
    """Train one step of `attested` itself, the step a lab attests and runs."""
    proof = zkdv.torch.ZKDV(tmp_path / "proof", config=EVERY_STEP)
    proof.start(rolling_window=2)
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    proof.attest(lambda m, o, b: attested(proof, m, o, b))
    batch = (torch.randn(4, 3), torch.randint(2, (4,)))
    try:
        with proof.transaction(batch=batch):
            attested(proof, model, optimizer, batch)
    finally:
        proof.close()


def test_a_stateful_module_outside_the_prepared_root_is_rejected(tmp_path: Path) -> None:
    head = nn.Linear(2, 2)

    def attested(proof, model, optimizer, batch):
        logits = head(proof.forward(model, batch[0]))
        proof.backward(functional.cross_entropy(logits, batch[1]))
        optimizer.step()

    with pytest.raises(
        RuntimeError, match=r"captured unprepared tensor state .*proof\.prepare\(\)"
    ):
        _run(tmp_path, nn.Linear(3, 2), attested)


def test_calling_the_prepared_module_directly_traces_its_state(tmp_path: Path) -> None:
    # The traced state stays in place for the whole attested step (activation
    # checkpointing recomputes in the backward pass), so model(x) computes with it, as
    # proof.forward(model, x) does: the program's gradients are the step's.
    def attested(proof, model, optimizer, batch):
        proof.backward(functional.cross_entropy(model(batch[0]), batch[1]))
        optimizer.step()

    _run(tmp_path, nn.Linear(3, 2), attested)
    assert verify_transcript(tmp_path / "proof").ok
    verdict = torch_replay.verify_challenge(tmp_path / "proof", 0)
    assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_loss_backward_in_the_attested_step_is_proof_backward(tmp_path: Path) -> None:
    # What frameworks' own steps call (Accelerate's backward, Lightning's closure): the
    # trace differentiates it as proof.backward does, micro-batches accumulating.
    from provers import torch_replay

    every_step = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
    proof = zkdv.torch.ZKDV(tmp_path / "proof", every_step)
    proof.start(rolling_window=2)
    model = nn.Linear(3, 2)
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    @proof.attest
    def step(model, optimizer, batch):
        inputs, targets = batch
        for rows in (slice(0, 2), slice(2, 4)):
            (functional.cross_entropy(model(inputs[rows]), targets[rows]) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        for _ in range(3):
            batch = (torch.randn(4, 3), torch.randint(2, (4,)))
            with proof.transaction(batch=batch):
                step(model, optimizer, batch)
    finally:
        proof.close()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok and report.checks == 3, report.summary()
    verdict = torch_replay.verify_challenge(tmp_path / "proof", 0, through=2)
    assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_loss_backward_with_inputs_in_the_attested_step_is_refused(tmp_path: Path) -> None:
    def attested(proof, model, optimizer, batch):
        loss = functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward(inputs=[model.weight])
        optimizer.step()

    with pytest.raises(RuntimeError, match=r"loss\.backward\(inputs=\.\.\.\) inside the attested"):
        _run(tmp_path, nn.Linear(3, 2), attested)


def test_forward_of_an_unprepared_model_is_rejected(tmp_path: Path) -> None:
    other = nn.Linear(3, 2)

    def attested(proof, model, optimizer, batch):
        proof.backward(functional.cross_entropy(proof.forward(other, batch[0]), batch[1]))
        optimizer.step()

    with pytest.raises(
        RuntimeError,
        match=r"proof\.forward\(\) received an unprepared model; pass it through proof\.prepare\(\) first",
    ):
        _run(tmp_path, nn.Linear(3, 2), attested)


def test_random_operators_without_a_generator_are_rejected(tmp_path: Path) -> None:
    # native_dropout draws from the global generator and takes none of its own, so a
    # replay on another thread could not draw the same mask: refused.
    def attested(proof, model, optimizer, batch):
        hidden, _ = torch.native_dropout(proof.forward(model, batch[0]), 0.5, True)
        proof.backward(functional.cross_entropy(hidden, batch[1]))
        optimizer.step()

    with pytest.raises(RuntimeError, match=r"contains random operations .*outside the transition"):
        _run(tmp_path, nn.Linear(3, 2), attested)


def test_a_compiled_program_refuses_random_operators(tmp_path: Path) -> None:
    # Dropout is fine in the default eager-kernel program; compiled code would draw its
    # mask with Inductor's own generator, unlike the eager step. Refused before compiling.
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))

    def attested(proof, model, optimizer, batch):
        proof.backward(functional.cross_entropy(proof.forward(model, batch[0]), batch[1]))
        optimizer.step()

    proof = zkdv.torch.ZKDV(tmp_path / "proof")
    proof.start(rolling_window=2)
    proof.program_kind = "aot-inductor"
    model, _ = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    proof.attest(lambda m, o, b: attested(proof, m, o, b))
    batch = (torch.randn(4, 3), torch.randint(2, (4,)))
    with (
        pytest.raises(RuntimeError, match=r"random operations .*compiled \(aot-inductor\)"),
        proof.transaction(batch=batch),
    ):
        pass
    proof.close()


def test_literal_tensors_and_stateless_modules_pass_through(tmp_path: Path) -> None:
    activation = nn.GELU()

    def attested(proof, model, optimizer, batch):
        scale = torch.tensor(0.5)
        logits = activation(proof.forward(model, batch[0])) * scale
        proof.backward(functional.cross_entropy(logits, batch[1]))
        optimizer.step()

    _run(tmp_path, nn.Linear(3, 2), attested)
    assert verify_transcript(tmp_path / "proof").ok
    verdict = torch_replay.verify_challenge(tmp_path / "proof", 0)
    assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_the_attested_step_must_step_the_optimizer(tmp_path: Path) -> None:
    def attested(proof, model, optimizer, batch):
        functional.cross_entropy(proof.forward(model, batch[0]), batch[1])

    with pytest.raises(
        RuntimeError, match=r"call proof\.backward\(loss\) and then optimizer\.step\(\)"
    ):
        _run(tmp_path, nn.Linear(3, 2), attested)


def test_an_unknown_program_kind_is_rejected(tmp_path: Path) -> None:
    proof = zkdv.torch.ZKDV(tmp_path / "proof")
    proof.start(rolling_window=2)
    proof.program_kind = "pickle"
    model = nn.Linear(3, 2)
    model, _ = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    @proof.attest
    def attested(model, optimizer, batch):
        proof.backward(functional.cross_entropy(proof.forward(model, batch[0]), batch[1]))
        optimizer.step()

    with pytest.raises(ValueError, match="unknown ZKDV Torch program kind 'pickle'"):
        proof.transaction(batch=(torch.randn(4, 3), torch.randint(2, (4,))))
    proof.close()
