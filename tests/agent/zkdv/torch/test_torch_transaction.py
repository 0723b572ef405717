"""Eager transactions through the shared pipeline: commitments, checks, poisoning.

Each run seals its attested step as a ``torch.export`` program (see conftest) and
checks every step (``DEBUGCheckEvery(1)``), so every transcript holds replayed values
for every step; every transcript produced must pass the offline verifier.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv import workers
from zkdv.files import TREES, read_batch, read_state, snapshot_path
from zkdv.merkle import LeafSpec
from zkdv.records import iter_records
from zkdv.torch._packing import BatchLayout
from zkdv.torch.forgery import hide_learning_rate
from zkdv.verify import verify_transcript

EVERY_STEP = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1), chunk_bytes=256
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _proof(tmp_path: Path, interval: int = 3, config: zkdv.ZKDVConfig = EVERY_STEP):
    proof = zkdv.torch.ZKDV(tmp_path / "proof", config, replay_snapshot_interval=interval)
    proof.start(rolling_window=4, probe_ratio=0.5)
    return proof


def _attest(proof: Any) -> Callable[..., None]:
    @proof.attest
    def attested_step(model, optimizer, batch):
        inputs, targets = batch
        loss = functional.cross_entropy(proof.forward(model, inputs), targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return attested_step


def _batches(count: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 10, generator=generator), torch.randint(2, (8,), generator=generator))
        for _ in range(count)
    ]


def _train(proof, model, optimizer, batches, *, before_step=None, after_entry=None) -> None:
    for index, (inputs, targets) in enumerate(batches):
        with proof.transaction(batch=(inputs, targets)):
            if after_entry is not None:
                after_entry(index, inputs, targets)
            loss = functional.cross_entropy(model(inputs), targets)
            proof.backward(loss)
            if before_step is not None:
                before_step(index)
            optimizer.step()
            optimizer.zero_grad()


def _verified(path: Path) -> zkdv.verify.VerificationReport:
    report = verify_transcript(path)
    assert report.ok, report.summary()
    # The command-line verifier agrees.
    result = subprocess.run(
        [sys.executable, "-m", "zkdv", "verify", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return report


def _trained(tmp_path: Path, steps: int) -> Any:
    """A proof of ``steps`` AdamW steps of the BatchNorm model, still open."""
    proof = _proof(tmp_path)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = proof.prepare(model, optimizer)
    _attest(proof)
    _train(proof, model, optimizer, _batches(steps))
    return proof


def test_eager_transactions_commit_check_and_verify(tmp_path: Path) -> None:
    _trained(tmp_path, 7).close()
    report = _verified(tmp_path / "proof")
    assert (report.steps, report.checks, report.snapshots) == (7, 7, [0, 3, 6])
    root = report.root
    assert root["prover"] == "whitebox-torch"
    assert root["program"]["kind"] == "torch.export"
    assert root["env"]["optimizer"]["contract"] == "AdamW"
    # BatchNorm running statistics are committed state.
    assert [leaf["path"] for leaf in root["schema"]["buffers"]] == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    checks = [r.data for r in iter_records(tmp_path / "proof") if r.data["t"] == "check"]
    assert [c["from"] for c in checks] == [0, 0, 0, 3, 3, 3, 6]
    assert all(c["param"]["committed"] != 0.0 for c in checks)
    # The program bytes on disk are the committed ones; snapshot files hash to roots.
    program = (tmp_path / "proof" / "program.bin").read_bytes()
    assert zkdv.core.file_digest(program) == root["program"]["digest"]
    specs = [LeafSpec.from_dict(s) for s in root["schema"]["opt_state"]]
    _, commitment = read_state(snapshot_path(tmp_path / "proof", 0, "opt_state"), specs, 256)
    assert commitment.root == root["initial"]["o"]


@pytest.mark.skipif(not workers.idle(), reason="workers run at normal priority here")
def test_commitments_checks_and_writes_run_on_idle_time(tmp_path: Path) -> None:
    # zkdv.workers: every stage the training overlaps with runs at SCHED_IDLE.
    proof = _trained(tmp_path, 4)
    proof.join()
    policies = {
        thread.name.split("_")[0]: os.sched_getscheduler(thread.native_id)
        for thread in threading.enumerate()
        if thread.name.startswith("zkdv-") and thread.native_id is not None
    }
    proof.close()
    assert {"zkdv-commit", "zkdv-check", "zkdv-snapshot", "zkdv-writer"} <= set(policies)
    assert set(policies.values()) == {os.SCHED_IDLE}, policies
    assert _verified(tmp_path / "proof").checks == 4


def test_snapshot_files_hash_to_their_roots_even_when_the_disk_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's host slot is reused only after its file is written.

    Seen in CI once direct I/O made snapshot writes slower: a slot that no replay needed
    any more was refilled with a later step's state while its file was still being
    written, so the file no longer hashed to the committed roots. A slow disk is
    simulated here by delaying each state file's write.
    """
    import time

    import zkdv.driver.base

    write_state = zkdv.driver.base.write_state

    def slow_write_state(path: Path, leaves: Any) -> int:
        time.sleep(0.15)
        return write_state(path, leaves)

    monkeypatch.setattr(zkdv.driver.base, "write_state", slow_write_state)
    commitments_only = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0), chunk_bytes=256
    )
    proof = _proof(tmp_path, interval=1, config=commitments_only)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _attest(proof)
    _train(proof, model, optimizer, _batches(10))
    proof.close()
    report = _verified(tmp_path / "proof")
    assert report.snapshots == list(range(10))
    root = report.root
    schema = {tree: [LeafSpec.from_dict(s) for s in root["schema"][tree]] for tree in TREES}
    snaps = [r.data for r in iter_records(tmp_path / "proof") if r.data["t"] == "snap"]
    assert [snap["i"] for snap in snaps] == list(range(10))
    for snap in snaps:
        for tree, key in zip(TREES, ("p", "o", "b"), strict=True):
            file = snapshot_path(tmp_path / "proof", snap["i"], tree)
            _, commitment = read_state(file, schema[tree], 256)
            assert commitment.root == snap["roots"][key], (snap["i"], tree)


def test_committed_batch_unpacks_to_the_step_inputs(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    # An optimizer over another model's parameters must not be bound to this model.
    with pytest.raises(
        ValueError, match="holds tensors that are not parameters of the prepared model"
    ):
        proof.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    proof.close()
    batch = (torch.randn(4, 3, dtype=torch.float64), torch.arange(4), torch.ones(4, 2).bool())
    layout = BatchLayout.of(batch)
    words = layout.pack(batch)
    assert words.dtype == np.uint32 and words.shape == (4, 2 * 3 + 2 + 1)
    again = layout.unpack(words)
    for original, restored in zip(batch, again, strict=True):
        assert torch.equal(original, restored) and original.dtype == restored.dtype


def test_batch_files_are_kept_for_the_platform(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _attest(proof)
    batches = _batches(2)
    _train(proof, model, optimizer, batches)
    proof.close()
    _verified(tmp_path / "proof")
    words = read_batch(tmp_path / "proof" / "files" / "batch-00000001.u32")
    layout = BatchLayout.of(batches[1])
    inputs, targets = layout.unpack(words)
    assert torch.equal(inputs, batches[1][0]) and torch.equal(targets, batches[1][1])


def _poisoned(proof) -> BaseException:
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    return raised.value


def _run_tampered(
    tmp_path: Path,
    optimizer_factory,
    reasons: tuple[str, ...] = ("failed_check",),
    prepared: Any = None,
    **hooks: Any,
) -> Any:
    # One replay window over the whole run: every check replays from step 0's snapshot,
    # so a divergence at any step stays visible to every later check.
    proof = _proof(tmp_path, interval=12)
    model = _model()
    model, optimizer = proof.prepare(model, optimizer_factory(model))
    if prepared is not None:
        prepared(optimizer)
    _attest(proof)
    # A failed check poisons the next call as soon as it completes.
    with contextlib.suppress(zkdv.ZKDVPoisonedError):
        _train(proof, model, optimizer, _batches(6), **hooks)
    error = _poisoned(proof)
    assert isinstance(error.__cause__, zkdv.ZKDVVerificationError), error
    report = verify_transcript(tmp_path / "proof")
    assert not report.ok and report.reason in reasons, report.summary()
    return error


def test_hyperparameters_differing_from_the_attested_ones_are_caught(tmp_path: Path) -> None:
    def factory(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # The update uses 10x the learning rate, the record says 1x.
    error = _run_tampered(tmp_path, factory, prepared=lambda o: hide_learning_rate(o, 10.0))
    assert "sampled check of step" in str(error.__cause__)


def test_parameters_changed_outside_the_step_are_caught(tmp_path: Path) -> None:
    holder: dict[str, nn.Module] = {}

    def factory(model: nn.Module) -> torch.optim.Optimizer:
        holder["model"] = model
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def tamper(index: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if index == 2:
            with torch.no_grad():
                holder["model"][3].weight[0].add_(0.5)  # one class only: not softmax-invariant

    # The change races with step 1's commitment, which may still be reading the live
    # parameters (only optimizer.step() waits for it), so step 1 or step 2 fails its
    # check. The offline verifier sees it too: probes of the pre-update parameters no
    # longer continue the committed post-update ones.
    error = _run_tampered(
        tmp_path, factory, ("probe_discontinuity", "failed_check"), after_entry=tamper
    )
    assert any(f"step {step} failed" in str(error.__cause__) for step in (1, 2, 3, 4, 5))


def test_a_batch_mutated_after_commitment_is_caught(tmp_path: Path) -> None:
    def mutate(index: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if index == 1:
            inputs.mul_(-3.0)  # after the transaction committed (copied) the batch

    error = _run_tampered(
        tmp_path, lambda model: torch.optim.Adam(model.parameters(), lr=1e-2), after_entry=mutate
    )
    assert any(f"step {step} failed" in str(error.__cause__) for step in (1, 2, 3, 4, 5))


def test_static_options_changed_after_attestation_are_rejected(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _attest(proof)
    batches = _batches(2)
    _train(proof, model, optimizer, batches[:1])
    optimizer.param_groups[0]["maximize"] = True
    with pytest.raises(RuntimeError, match="prepared optimizer options changed after attestation"):
        _train(proof, model, optimizer, batches[1:])
    proof.close()
    _verified(tmp_path / "proof")


def test_tensor_options_set_after_attestation_are_rejected(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _attest(proof)
    _train(proof, model, optimizer, _batches(1))
    optimizer.param_groups[0]["lr"] = torch.tensor(0.05)
    with pytest.raises(RuntimeError, match=r"requires static optimizer options, but \('lr',\)"):
        _train(proof, model, optimizer, _batches(1))
    proof.close()


def test_nested_transactions_are_rejected(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _attest(proof)
    inputs, targets = _batches(1)[0]
    with proof.transaction(batch=(inputs, targets)):
        with pytest.raises(RuntimeError, match="nested ZKDV Torch transactions are unsupported"):
            proof.transaction(batch=(inputs, targets))
        proof.backward(functional.cross_entropy(model(inputs), targets))
        optimizer.step()
    proof.close()
    _verified(tmp_path / "proof")


def test_a_transaction_without_a_step_or_attestation_says_what_to_do(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = _batches(1)[0]
    with pytest.raises(RuntimeError, match=r"decorate it with @proof\.attest"):
        proof.transaction(batch=(inputs, targets))
    _attest(proof)
    with (
        pytest.raises(RuntimeError, match=r"must call optimizer\.step\(\)"),
        proof.transaction(batch=(inputs, targets)),
    ):
        pass
    _train(proof, model, optimizer, [(inputs, targets)])
    proof.close()
    _verified(tmp_path / "proof")


def test_outside_a_transaction_the_optimizer_is_native(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = nn.Linear(3, 1)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    model, optimizer = proof.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
    native = torch.optim.Adam(reference.parameters(), lr=0.1)
    for _ in range(3):
        inputs = torch.randn(4, 3)
        for m, o in ((model, optimizer), (reference, native)):
            o.zero_grad()
            m(inputs).sum().backward()
            o.step()
    assert torch.equal(model.weight, reference.weight)
    proof.close()


def test_random_sampling_policy_writes_a_valid_transcript(tmp_path: Path) -> None:
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.3), chunk_bytes=256
    )
    proof = _proof(tmp_path, interval=4, config=config)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.RMSprop(model.parameters(), lr=1e-3))
    _attest(proof)
    _train(
        proof,
        model,
        optimizer,
        _batches(10),
    )
    proof.close()
    report = _verified(tmp_path / "proof")
    assert report.steps == 10 and report.checks == len(report.sampled)
    # Everything a finished window needed was dropped; only the last window remains.
    assert proof._checkpoint is not None and set(proof._checkpoint.snapshots) <= {8}


class _Masked(nn.Module):
    """Branches on its batch's values, as transformers' attention does on its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 2)

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.all():  # no masking needed: a cheaper path
            return self.linear(inputs)
        return self.linear(inputs * mask[:, None])


def _masked_step(proof: Any) -> Callable[..., None]:
    """The attested step of a :class:`_Masked` model, its batch ``(inputs, mask, targets)``."""

    @proof.attest
    def attested_step(model, optimizer, batch):
        inputs, mask, targets = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs, mask), targets))
        optimizer.step()
        optimizer.zero_grad()

    return attested_step


def test_a_batch_that_takes_another_branch_is_refused_before_commitment(
    tmp_path: Path,
) -> None:
    proof = _proof(tmp_path)
    model = _Masked()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    attested_step = _masked_step(proof)

    (inputs, targets), (more, labels) = _batches(2)
    unmasked = (inputs, torch.ones(8), targets)
    with proof.transaction(batch=unmasked):
        attested_step(model, optimizer, unmasked)
    masked = (more, (torch.arange(8) % 2).float(), labels)
    with (
        pytest.raises(
            RuntimeError, match=r"another branch .* was True when the program was sealed"
        ),
        proof.transaction(batch=masked),
    ):
        pass
    # The same kind of batch as the first goes on.
    again = (more, torch.ones(8), labels)
    with proof.transaction(batch=again):
        attested_step(model, optimizer, again)
    proof.close()
    report = _verified(tmp_path / "proof")
    assert report.steps == 2 and report.checks == 2
    guards = report.root["env"]["program"]["guards"]
    assert [guard["value"] for guard in guards] == [True]


class _MaskedDropout(_Masked):
    """:class:`_Masked` with dropout, as a Hugging Face model has."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(self.dropout(inputs), mask)


def test_a_guard_computes_only_its_reads_not_the_step(tmp_path: Path) -> None:
    # A guard runs before every step: a guard that kept the step's random draws (which
    # graph dead-code elimination leaves by default) ran the whole step a second time and
    # advanced the random state the step then drew its dropout from.
    proof = _proof(tmp_path)
    model = _MaskedDropout()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    attested_step = _masked_step(proof)

    for inputs, targets in _batches(3):
        batch = (inputs, torch.ones(8), targets)
        with proof.transaction(batch=batch):
            attested_step(model, optimizer, batch)
    lowered = proof._lowered_program
    assert lowered is not None and lowered.guards.module is not None
    operators = {
        str(node.target) for node in lowered.guards.module.graph.nodes if node.op == "call_function"
    }
    # The reads (mask.all()) and what they need: no product, no random draw.
    step_like = {
        op for op in operators if any(w in op for w in ("mm", "dropout", "bernoulli", "rand"))
    }
    assert operators and not step_like, operators
    arguments = (*model.parameters(), torch.randn(8, 10), torch.ones(8), targets)
    state = torch.get_rng_state()
    lowered.guards.check(arguments)
    assert torch.equal(torch.get_rng_state(), state)
    proof.close()
    assert _verified(tmp_path / "proof").steps == 3


def test_unfreezing_a_parameter_after_attestation_is_refused(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _model()
    model[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = proof.prepare(model, torch.optim.SGD(trained, lr=0.1))
    _attest(proof)
    batches = _batches(2)
    _train(proof, model, optimizer, batches[:1])
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"require gradients changed .*0\.weight: False -> True"):
        _train(proof, model, optimizer, batches[1:])
    proof.close()
    _verified(tmp_path / "proof")


CLIPPINGS = {
    "norm 2": lambda p: torch.nn.utils.clip_grad_norm_(p, 0.05),
    "norm inf": lambda p: torch.nn.utils.clip_grad_norm_(p, 0.01, norm_type=float("inf")),
    "norm 1, foreach": lambda p: torch.nn.utils.clip_grad_norm_(p, 0.1, norm_type=1, foreach=True),
    "error if nonfinite": lambda p: torch.nn.utils.clip_grad_norm_(
        p, 0.05, error_if_nonfinite=True
    ),
    "value": lambda p: torch.nn.utils.clip_grad_value_(p, 0.01),
}


@pytest.mark.parametrize("clipping", sorted(CLIPPINGS))
def test_gradient_clipping_is_part_of_the_checked_and_replayed_step(
    clipping: str, tmp_path: Path
) -> None:
    from provers import torch_replay

    clip = CLIPPINGS[clipping]
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))

    @proof.attest
    def attested_step(model, optimizer, batch):
        inputs, targets = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs), targets))
        clip(model.parameters())
        optimizer.step()
        optimizer.zero_grad()

    for batch in _batches(5):
        with proof.transaction(batch=batch):
            attested_step(model, optimizer, batch)
    proof.close()
    report = _verified(tmp_path / "proof")
    assert report.checks == 5
    for step in range(5):
        verdict = torch_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


class _Checkpointed(nn.Module):
    """A block recomputed in the backward pass (activation checkpointing)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.hidden = nn.Linear(10, 32)
        self.out = nn.Linear(32, 2)
        self.dropout = nn.Dropout(dropout)

    def block(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.hidden(inputs)))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(self.block, inputs, use_reentrant=False))


def test_activation_checkpointing_is_checked_and_replayed(tmp_path: Path) -> None:
    from provers import torch_replay

    proof = _proof(tmp_path)
    model = _Checkpointed(dropout=0.0)
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    _attest(proof)
    _train(proof, model, optimizer, _batches(4))
    proof.close()
    assert _verified(tmp_path / "proof").checks == 4
    for step in range(4):
        verdict = torch_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_checkpointing_that_redraws_dropout_is_refused(tmp_path: Path) -> None:
    proof = _proof(tmp_path)
    model = _Checkpointed(dropout=0.2)
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    _attest(proof)
    with pytest.raises(RuntimeError, match=r"sets a random generator's state back"):
        _train(proof, model, optimizer, _batches(1))
    proof.close()


def test_a_step_in_eval_mode_or_on_other_threads_is_refused(tmp_path: Path) -> None:
    # A validation pass between steps must give training mode back, and the thread count
    # the program was sealed with stays: a replay applies both.
    proof = _proof(tmp_path)
    model = _model()
    model, optimizer = proof.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _attest(proof)
    batches = _batches(3)
    _train(proof, model, optimizer, batches[:1])
    model.eval()
    with pytest.raises(RuntimeError, match=r"other settings .* the model is in eval mode"):
        _train(proof, model, optimizer, batches[1:2])
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(RuntimeError, match=rf"threads is {threads + 1}, was {threads}"):
            _train(proof, model, optimizer, batches[1:2])
    finally:
        torch.set_num_threads(threads)
    _train(proof, model, optimizer, batches[1:])
    proof.close()
    assert _verified(tmp_path / "proof").steps == 3
