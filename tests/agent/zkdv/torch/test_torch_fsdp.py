"""FSDP2 (``fully_shard``) with the gloo backend across two CPU processes.

Rank 0 owns the tape through HostControl, as under DDP. The committed state is the full
model and optimizer state, all-gathered from the shards on every rank at each step's end;
the committed batch holds both ranks' rows, so a sampled check on rank 0 (and the
platform prover, in one process) replays the full model on the global batch, which
reproduces FSDP2's rank-averaged, reduce-scattered gradient. A shard changed outside the
optimizer on rank 1 is caught by rank 0's sampled check, and every rank's close() raises.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from provers.torch_replay import exact_environment, verify_challenge
from tests.sources import AGENT_PYTHONPATH
from zkdv.config import DEFAULT_CHUNK_BYTES
from zkdv.merkle import commit_state
from zkdv.records import iter_records
from zkdv.torch._model import plain_structure, refresh_structure
from zkdv.verify import verify_transcript

REPO_ROOT = Path(__file__).resolve().parents[4]

WORKER = r"""
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional

import zkdv


def model_on(mesh, *, root=True):
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def worker(rank, world, port, directory, mode):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    outcome = {"rank": rank}
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,))
        # A model whose root is not sharded keeps plain parameters FSDP2 never averages.
        try:
            zkdv.torch.ZKDV(Path(directory) / f"partial-{rank}").prepare(
                model_on(mesh, root=False).append(nn.Linear(3, 3))
            )
        except ValueError as error:
            outcome["partial"] = str(error)
        # A cast forward is not what a full-precision replay computes.
        cast = nn.Linear(4, 4)
        fully_shard(cast, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        try:
            zkdv.torch.ZKDV(Path(directory) / f"cast-{rank}").prepare(cast)
        except ValueError as error:
            outcome["precision"] = str(error)
        model = model_on(mesh)
        config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(2))
        proof = zkdv.torch.ZKDV(Path(directory) / "proof", config, replay_snapshot_interval=3)
        proof.start(rolling_window=4, probe_ratio=0.5)
        model, optimizer = proof.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        )
        stray = nn.Parameter(torch.ones(()))

        @proof.attest
        def attested_step(model, optimizer, batch):
            inputs, targets = batch
            logits = proof.forward(model, inputs)
            if mode == "unsealable":
                # State the proof never prepared: the lowering refuses to seal it.
                logits = logits * stray
            loss = functional.cross_entropy(logits, targets)
            proof.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        generator = torch.Generator().manual_seed(100 + rank)
        try:
            for step in range(6):
                inputs = torch.randn(8, 10, generator=generator)
                targets = torch.randint(3, (8,), generator=generator)
                if mode == "tamper" and rank == 1 and step == 4:
                    # Rank 1's shards, outside the optimizer. Every one of them, so that
                    # whichever coordinates the check samples, its update or optimizer
                    # state differs: a smaller edit (one shard of one weight) is caught
                    # only when the sampled coordinate depends on it, which made this
                    # test fail about one run in eight.
                    with torch.no_grad():
                        for parameter in model.parameters():
                            parameter.to_local().mul_(3.0)
                with proof.transaction(batch=(inputs, targets)):
                    loss = functional.cross_entropy(model(inputs), targets)
                    proof.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        except (zkdv.ZKDVPoisonedError, RuntimeError) as error:
            outcome["raised"] = f"{type(error).__name__}: {error}"
        try:
            proof.close()
            outcome["closed"] = "ok"
        except zkdv.ZKDVPoisonedError as error:
            outcome["closed"] = "poisoned: " + str(error)
        outcome["digest"] = proof.digest.hex() if proof.digest else None
        outcome["follower"] = proof.follower
        # The full parameters after training, gathered from the shards (every rank).
        outcome["full"] = {
            name: parameter.full_tensor().detach().reshape(-1).tolist()
            for name, parameter in model.named_parameters()
        }
        outcome["shapes"] = {name: list(p.shape) for name, p in model.named_parameters()}
    finally:
        Path(directory, f"rank-{rank}.json").write_text(json.dumps(outcome))
        # Neither rank tears its gloo pairs down while the other may still be in a
        # collective (once in CI rank 1 died of std::terminate while rank 0 still ran).
        dist.barrier()
        dist.destroy_process_group()
    # Every result is on disk and the process groups are gone: leave without the
    # interpreter's finalisation. In it, torch's distributed objects (the TCPStore rank 0
    # serves, gloo's threads) are torn down in no set order, and about one run in sixty
    # a rank aborted there ("terminate called without an active exception", rank 0 or
    # rank 1, after its results were written); zkdv holds no process group or thread
    # of torch's at that point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    directory, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(worker, args=(2, port, directory, mode), nprocs=2, join=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    script = tmp_path / "fsdp_run.py"
    script.write_text(WORKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            AGENT_PYTHONPATH,
            env.get("PYTHONPATH", ""),
        ]
    )
    env["ZKDV_TORCH_PROGRAM"] = "torch.export"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(_free_port()), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_run_commits_the_full_state_and_replays_on_one_process(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, "clean")
    assert (owner["closed"], follower["closed"]) == ("ok", "ok")
    assert (owner["follower"], follower["follower"]) == (False, True)
    assert owner["digest"] == follower["digest"] is not None
    # A partly sharded model is rejected at prepare() with the fix.
    assert "call fully_shard() on the root module too" in owner["partial"]
    assert "sharded: 3.weight, 3.bias are not DTensors" in owner["partial"]
    assert "without a MixedPrecisionPolicy (param_dtype=torch.bfloat16" in owner["precision"]

    proof = tmp_path / "proof"
    report = verify_transcript(proof)
    assert report.ok, report.summary()
    assert (report.steps, report.checks) == (6, 3)
    assert report.digest == owner["digest"]
    env = report.root["env"]
    assert env["world_size"] == 2
    assert env["fsdp"] == {"world_size": 2, "mesh": [[2]], "placements": [["S(0)"]]}
    # The committed layout is the full model's, not one rank's shard.
    shapes = {spec["path"]: spec["shape"] for spec in report.root["schema"]["params"]}
    assert shapes == owner["shapes"]
    steps = [r.data for r in iter_records(proof) if r.data["t"] == "step"]
    assert {step["batch"]["rows"] for step in steps} == {2 * env["batch"]["rows"]}

    # The last committed parameter root is the root of the gathered full parameters.
    leaves = [
        (name, np.asarray(values, dtype=np.float32).reshape(owner["shapes"][name]))
        for name, values in owner["full"].items()
    ]
    assert owner["full"] == follower["full"]
    assert commit_state(leaves, DEFAULT_CHUNK_BYTES).root == steps[-1]["post"]["p"]

    # The platform prover, in one process: never claimed bit-exact, passes within tolerance.
    assert not exact_environment(report.root)
    single = verify_challenge(proof, 4)
    assert single.ok, single
    window = verify_challenge(proof, 3, through=5)
    assert window.ok, window
    assert [evidence.step for evidence in window.evidence] == [3, 4, 5]


@pytest.mark.slow
@pytest.mark.timeout(600)  # its ranks have 300 s
def test_fsdp2_shard_changed_outside_the_optimizer_poisons_every_rank(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, "tamper")
    failure = "sampled check of step 4 failed: parameter"
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
