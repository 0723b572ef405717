"""DDP with the gloo backend across two CPU processes (torch.multiprocessing.spawn).

Rank 0 owns the tape through HostControl: one transcript, one logical update per step,
committed from rank 0's replica; the committed batch holds both ranks' rows, so sampled
checks replay the averaged DDP gradient. A batch mutated after commitment on rank 1 is
caught by rank 0's check and every rank's close() raises.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources import AGENT_PYTHONPATH
from zkdv.records import iter_records
from zkdv.verify import verify_transcript

REPO_ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.slow

WORKER = r"""
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

import zkdv


def worker(rank, world, port, directory, tamper):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    outcome = {"rank": rank}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(10, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)
        )
        model = DistributedDataParallel(model)
        config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
        proof = zkdv.torch.ZKDV(Path(directory) / "proof", config, replay_snapshot_interval=3)
        proof.start(rolling_window=4, probe_ratio=0.5)
        model, optimizer = proof.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )

        @proof.attest
        def attested_step(model, optimizer, batch):
            inputs, targets = batch
            loss = functional.cross_entropy(proof.forward(model, inputs), targets)
            proof.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        generator = torch.Generator().manual_seed(100 + rank)
        try:
            for step in range(6):
                inputs = torch.randn(8, 10, generator=generator)
                targets = torch.randint(2, (8,), generator=generator)
                with proof.transaction(batch=(inputs, targets)):
                    if tamper and rank == 1 and step == 2:
                        inputs.mul_(-4.0)
                    loss = functional.cross_entropy(model(inputs), targets)
                    proof.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        except zkdv.ZKDVPoisonedError:
            pass  # rank 0 may learn of a failed check before its last step
        try:
            proof.close()
            outcome["closed"] = "ok"
        except zkdv.ZKDVPoisonedError as error:
            outcome["closed"] = "poisoned: " + str(error)[:300]
        outcome["digest"] = proof.digest.hex() if proof.digest else None
        outcome["follower"] = proof.follower
        outcome["weight"] = model.module[3].weight.detach().reshape(-1).tolist()
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
    directory, port, tamper = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    mp.spawn(worker, args=(2, port, directory, tamper), nprocs=2, join=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(tmp_path: Path, tamper: bool) -> list[dict]:
    script = tmp_path / "ddp_run.py"
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
        [sys.executable, str(script), str(tmp_path), str(_free_port()), "1" if tamper else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(600)  # its ranks have 300 s
def test_ddp_rank_zero_owns_one_transcript_of_the_logical_updates(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, tamper=False)
    assert (owner["closed"], follower["closed"]) == ("ok", "ok")
    assert (owner["follower"], follower["follower"]) == (False, True)
    # One logical update: the replicas stayed identical, and both ranks know the digest.
    assert owner["weight"] == follower["weight"]
    assert owner["digest"] == follower["digest"] is not None
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert (report.steps, report.checks) == (6, 6)
    assert report.digest == owner["digest"]
    assert report.root["env"]["world_size"] == 2
    # The committed batch holds both ranks' rows.
    steps = [r.data for r in iter_records(tmp_path / "proof") if r.data["t"] == "step"]
    assert {step["batch"]["rows"] for step in steps} == {2 * report.root["env"]["batch"]["rows"]}


@pytest.mark.timeout(600)  # its ranks have 300 s
def test_ddp_batch_mutated_on_a_follower_poisons_every_rank(tmp_path: Path) -> None:
    owner, follower = _run(tmp_path, tamper=True)
    assert owner["closed"].startswith("poisoned"), owner
    assert follower["closed"].startswith("poisoned"), follower
    report = verify_transcript(tmp_path / "proof")
    assert (report.ok, report.reason) == (False, "failed_check")
