"""FSDP2 (``fully_shard``) training over gloo processes, for the tests and the benches.

:func:`train` runs :data:`WORKER` in a fresh process that spawns ``world`` ranks on one
CPU kernel family and thread count: an MLP block sharded layer by layer, AdamW (or
Adadelta: ``native``) under a ``LambdaLR`` schedule, six steps of 8 rows per rank, rank
0 writing ``DIR/proof``. Each rank writes its outcome to ``DIR/rank-<rank>.json``. The
modes: ``clean``; ``native`` (no canonical update); ``tamper`` (rank 1's shards changed
outside the optimizer before step 4); ``gradient`` (every rank's reduced gradient 1 %
larger at step 3, the step the SDK's own checks do not sample); ``unsealable``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.sources import AGENT_PYTHONPATH
from zkdv.calibrate import kernels

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
    # An MLP block as users write one. Under four ranks the last layer's 3 rows shard
    # unevenly (1, 1, 1, 0): one rank holds empty shards of it.
    model = nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def worker(rank, world, port, directory, mode, threads, seed):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    outcome = {"rank": rank}
    try:
        torch.manual_seed(seed)
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
        if mode == "native":  # no canonical update: torch.optim's own, on the shards
            native = torch.optim.Adadelta(model.parameters(), lr=0.5)
        else:
            native = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        model, optimizer = proof.prepare(model, native)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
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

        generator = torch.Generator().manual_seed(100 + rank + 10 * seed)
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
                    if mode == "gradient" and step == 3:
                        # Every rank's reduced gradient 1 % larger than the batch gives:
                        # the committed gradient is what the optimizer read.
                        for parameter in model.parameters():
                            parameter.grad.to_local().mul_(1.01)
                    optimizer.step()
                    optimizer.zero_grad()
                schedule.step()
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
    world, threads, seed = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    mp.spawn(worker, args=(world, port, directory, mode, threads, seed), nprocs=world, join=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def train(
    directory: Path, mode: str, *, world: int, kernel: str, threads: int, seed: int = 0
) -> subprocess.CompletedProcess[str]:
    """Train on ``world`` gloo processes into ``directory``, on CPU kernel family
    ``kernel`` (:func:`zkdv.calibrate.kernels`) with ``threads`` threads each."""
    script = directory / "fsdp_run.py"
    script.write_text(WORKER)
    env = {**os.environ, **kernels(kernel)}
    env["PYTHONPATH"] = os.pathsep.join([AGENT_PYTHONPATH, env.get("PYTHONPATH", "")])
    env["ZKDV_TORCH_PROGRAM"] = "torch.export"
    port = str(_free_port())
    arguments = [str(directory), port, mode, str(world), str(threads), str(seed)]
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
