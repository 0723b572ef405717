"""FSDP2 (``fully_shard``) with the gloo backend across two and four CPU processes.

Rank 0 owns the tape through HostControl, as under DDP. The committed state is the full
model and optimizer state, all-gathered from the shards on every rank at each step's end,
and every step commits the full gradient (FSDP2's reduce-scattered, rank-averaged one,
gathered); each rank applies the canonical update to its own shards. The committed batch
holds every rank's rows, so a sampled check on rank 0 (and the platform prover, in one
process, here on another CPU kernel family than training's) recomputes the gradient
within the run's bounds and the committed state bit for bit. A shard changed outside the
optimizer on rank 1 is caught by rank 0's sampled check, and every rank's close()
raises; a committed gradient 1 % larger is caught by the platform's replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from provers.torch_replay import exact_environment, verify_challenge
from tests.agent.zkdv.torch import fsdp_runs
from zkdv.config import DEFAULT_CHUNK_BYTES
from zkdv.gradients import leaf_name
from zkdv.merkle import commit_state
from zkdv.records import iter_records
from zkdv.torch._model import plain_structure, refresh_structure
from zkdv.torch.optimizers.canonical import CANONICAL_VERSION
from zkdv.torch.replay import load_transition
from zkdv.verify import verify_transcript

REPO_ROOT = Path(__file__).resolve().parents[4]
HERE = torch.backends.cpu.get_cpu_capability().lower()
#: A CPU kernel family other than this process's, which the replays below run on.
OTHER = "default" if HERE != "default" else HERE


def _run(
    tmp_path: Path, mode: str, *, world: int = 2, kernel: str = HERE, threads: int = 1
) -> list[dict[str, Any]]:
    """Train on ``world`` gloo processes, on CPU kernel family ``kernel`` with
    ``threads`` threads each; every rank's outcome."""
    result = fsdp_runs.train(tmp_path, mode, world=world, kernel=kernel, threads=threads)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
@pytest.mark.parametrize(("world", "threads"), [(2, 1), (4, 2)])
def test_fsdp2_run_commits_its_gradients_and_replays_on_one_process_on_other_kernels(
    tmp_path: Path, world: int, threads: int
) -> None:
    """Trained on ``world`` ranks on another kernel family; replayed here in one process."""
    ranks = _run(tmp_path, "clean", world=world, kernel=OTHER, threads=threads)
    owner = ranks[0]
    assert [rank["closed"] for rank in ranks] == ["ok"] * world
    assert [rank["follower"] for rank in ranks] == [False] + [True] * (world - 1)
    assert {rank["digest"] for rank in ranks} == {owner["digest"]} != {None}
    if world == 2:
        # A partly sharded model is rejected at prepare() with the fix.
        assert "call fully_shard() on the root module too" in owner["partial"]
        assert "sharded: 4.weight, 4.bias are not DTensors" in owner["partial"]
        assert "without a MixedPrecisionPolicy (param_dtype=torch.bfloat16" in owner["precision"]

    proof = tmp_path / "proof"
    report = verify_transcript(proof)
    assert report.ok, report.summary()
    assert (report.steps, report.checks) == (6, 3)
    assert report.digest == owner["digest"]
    env = report.root["env"]
    assert (env["world_size"], env["cpu_capability"].lower(), env["threads"]) == (
        world,
        OTHER,
        threads,
    )
    assert env["fsdp"] == {"world_size": world, "mesh": [[world]], "placements": [["S(0)"]]}
    # The canonical update, and every step's full gradient committed.
    assert env["optimizer"]["canonical"] == CANONICAL_VERSION
    shapes = {spec["path"]: spec["shape"] for spec in report.root["schema"]["params"]}
    assert shapes == owner["shapes"]
    grad = {spec["path"]: spec["shape"] for spec in report.root["schema"]["grad"]}
    assert {path: grad[leaf_name("params", path)] for path in shapes} == shapes
    steps = [r.data for r in iter_records(proof) if r.data["t"] == "step"]
    assert {step["batch"]["rows"] for step in steps} == {world * env["batch"]["rows"]}
    # The schedule's learning rate, committed per step.
    assert [step["hp"][0]["lr"] for step in steps] == [0.01 * (1 / (1 + k)) for k in range(6)]

    # The last committed parameter root is the root of the gathered full parameters.
    leaves = [
        (name, np.asarray(values, dtype=np.float32).reshape(owner["shapes"][name]))
        for name, values in owner["full"].items()
    ]
    assert all(rank["full"] == owner["full"] for rank in ranks)
    assert commit_state(leaves, DEFAULT_CHUNK_BYTES).root == steps[-1]["post"]["p"]

    # The platform prover, in one process on this process's kernels: every step's
    # gradient within bounds (reduced across ranks, it is not one process's bit for
    # bit), and the canonical update of it gives the committed state bit for bit (a
    # replay of a canonical run fails on any other state: provers.replay).
    assert not exact_environment(report.root)
    assert load_transition(proof).canonical
    window = verify_challenge(proof, 0, through=5)
    assert window.ok, window
    assert [evidence.step for evidence in window.evidence] == list(range(6))
    for evidence in window.evidence:
        assert evidence.gradient is not None and evidence.gradient["margin"] < 1, evidence


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_shard_changed_outside_the_optimizer_poisons_every_rank(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, "tamper")
    failure = "sampled check of step 4 failed"
    assert owner["closed"].startswith("poisoned") and failure in owner["closed"], owner
    assert follower["closed"].startswith("poisoned: rank 0's ZKDV transcript is poisoned")
    assert failure in follower["closed"], follower
    report = verify_transcript(tmp_path / "proof")
    assert (report.ok, report.reason) == (False, "probe_discontinuity")
    assert "pre-update parameters of step 4 do not continue" in report.summary()
    verdict = verify_challenge(tmp_path / "proof", 4)
    assert not verdict.ok


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_committed_gradient_one_percent_larger_is_caught(tmp_path: Path) -> None:
    """A forged step the lab's own checks do not sample: the platform's replay catches it."""
    owner, follower = _run(tmp_path, "gradient")
    # The SDK checks steps 0, 2 and 4 (DEBUGCheckEvery(2)); the check of step 4 starts at
    # the snapshot of step 3 and applies step 3's committed gradient, as the platform does.
    assert (owner["closed"], follower["closed"]) == ("ok", "ok")
    proof = tmp_path / "proof"
    assert verify_transcript(proof).ok
    verdict = verify_challenge(proof, 3)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict
    assert "differ from the committed ones beyond the run's gradient bounds" in str(verdict.message)
    assert verdict.evidence[-1].gradient is not None
    assert verdict.evidence[-1].gradient["margin"] > 1
    assert verify_challenge(proof, 2).ok


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_optimizer_without_canonical_update_commits_gradients_too(tmp_path: Path) -> None:
    """Adadelta keeps torch.optim's sharded step; every rank still gathers the gradient."""
    owner, follower = _run(tmp_path, "native")
    assert (owner["closed"], follower["closed"]) == ("ok", "ok")
    proof = tmp_path / "proof"
    report = verify_transcript(proof)
    assert report.ok, report.summary()
    assert report.root["env"]["optimizer"]["canonical"] is None
    assert "grad" in report.root["schema"]
    assert not load_transition(proof).canonical
    window = verify_challenge(proof, 0, through=5)
    assert window.ok, window
    assert all(evidence.gradient is not None for evidence in window.evidence)


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_sealing_failure_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, "unsealable")
    # Rank 0 raises the lowering's own message; the follower, instead of blocking in
    # FSDP2's first all-gather, raises with rank 0's message at the same transaction.
    assert owner["raised"].startswith("RuntimeError: attested Torch code captured unprepared")
    assert follower["raised"].startswith(
        "ZKDVPoisonedError: rank 0 could not seal the attested program: attested Torch "
        "code captured unprepared tensor state"
    ), follower


def test_the_traced_copy_has_no_hooks_keeps_ties_and_follows_the_live_mode() -> None:
    """The module copy the program is traced on: FSDP2's hooks would issue collectives."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 3))
    model[2].weight = model[0].weight
    calls: list[str] = []
    model[0].register_forward_pre_hook(lambda *_: calls.append("hook"))
    copy = plain_structure(model)
    assert copy[0].weight is copy[2].weight and copy[0].weight.is_meta
    assert copy[0] is not model[0] and type(copy[0]) is nn.Linear

    model.eval()
    refresh_structure(model, copy)
    assert not copy[1].training
    inputs = torch.randn(4, 3)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    replayed = torch.func.functional_call(copy, state, (inputs,), tie_weights=True)
    assert calls == []
    assert torch.equal(replayed, model(inputs))
    assert calls == ["hook"]
