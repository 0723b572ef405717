"""Two JAX processes (jax.distributed over gloo on CPU): rank 0 owns the transcript.

Each process is a subprocess with two CPU devices, so the global mesh has four devices
across two processes. The parameters and optimizer state are replicated (data
parallelism), the batch is split across processes, and the one transcript rank 0
writes must verify and replay like a single-process one: the run commits its gradient
and the canonical update, and one device here reproduces the state bit for bit (the
gradient within the bounds). A weight nudged by 2**-20 in what rank 0 commits is
rejected.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest

import provers.jax_replay as jax_replay
from tests.processes import start, wait_all
from zkdv.replay import Transcript
from zkdv.verify import verify_transcript

ROOT = Path(__file__).resolve().parents[4]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address, rank, path, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(address, num_processes=2, process_id=rank)
    import jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import zkdv
    from zkdv.jax.contrib import TrainState

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    from jax.sharding import AxisType
    # Explicit mesh axes (jax.make_mesh's default); the split case uses Auto (GSPMD) axes.
    kind = AxisType.Auto if mode == "split" else AxisType.Explicit
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    # A forger turns off the SDK's own checks and, on rank 0, commits step 3's update
    # with one weight nudged by 2**-20: the state the processes train on is unchanged.
    policy = zkdv.SamplingPolicy(update_check_probability=0.0) if mode == "forged" else (
        zkdv.SamplingPolicy.DEBUGCheckEvery(2))
    config = zkdv.ZKDVConfig(sampling_policy=policy)
    if mode == "forged" and rank == 0:
        from zkdv.jax import _steps
        honest = _steps._Step.post_state

        def nudged(self):
            params, opt, extra = honest(self)
            if self.index == 3:
                path, w = params[0]
                w = w.copy()
                w.flat[0] += np.float32(2**-20)
                params = [(path, w), *params[1:]]
            return params, opt, extra

        _steps._Step.post_state = nudged
    proof = zkdv.jax.ZKDV(path, config, replay_snapshot_interval=3)
    proof.start(rolling_window=2)

    def apply_fn(variables, x):
        p = variables["params"]
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    w1 = jnp.ones((6, 8)) * 0.1
    params = {"w1": jax.device_put(w1, NamedSharding(mesh, P(None, "data")) if mode == "split" else replicated),
              "w2": jax.device_put(jnp.ones((8,)) * 0.1, replicated)}
    state = TrainState.create(proof=proof, apply_fn=apply_fn, params=params, tx=optax.adam(1e-2))
    state = jax.device_put(state, jax.tree.map(
        lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else replicated, state))

    @proof.jit(donate_argnums=(0,))
    def step(state, batch):
        def loss(p):
            y = state.apply_fn({"params": p}, batch[:, :6])
            return jnp.mean((y - batch[:, 6]) ** 2)
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rng = np.random.default_rng(rank)  # each process feeds its own rows
    result = {"rank": rank}
    try:
        for _ in range(5):
            local = rng.standard_normal((4, 7)).astype(np.float32)
            batch = jax.make_array_from_process_local_data(split, local)
            state = step(state, batch)
        proof.close()
        result["digest"] = proof.digest.hex()
        result["w2"] = np.asarray(state.params["w2"]).tolist()
    except zkdv.ZKDVError as error:
        result["error"] = str(error)
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two(tmp_path: Path, mode: str) -> list[dict[str, object]]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["ZKDV_JAX_EXPORT_PLATFORMS"] = ""
    env.pop("JAX_PLATFORMS", None)
    address = f"127.0.0.1:{_free_port()}"
    path = tmp_path / "proof"
    # The two ranks wait for each other: neither may block on output the test is not
    # reading yet, so both write to files (tests/processes.py).
    processes = [
        start(
            [sys.executable, "-c", SCRIPT, address, str(rank), str(path), mode],
            folder=tmp_path / f"{mode}-output",
            name=f"rank{rank}",
            merge=True,
            cwd=ROOT,
            env=env,
        )
        for rank in (0, 1)
    ]
    wait_all(processes, timeout=300)
    results = []
    for process in processes:
        lines = [line for line in process.stdout().splitlines() if line.startswith("RESULT ")]
        assert process.returncode == 0 and lines, process.tail()
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)  # _run_two gives its processes 300 s
def test_two_processes_write_one_transcript_that_verifies_and_replays(tmp_path: Path) -> None:
    rank0, rank1 = _run_two(tmp_path, "replicated")
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    # Both processes end with the same state and learn the same transcript digest.
    assert rank0["w2"] == rank1["w2"]
    assert rank0["digest"] == rank1["digest"]
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.digest == rank0["digest"]
    assert report.steps == 5
    assert report.root["env"]["process_count"] == 2
    # The run commits its gradient and the canonical update, as one process does.
    transcript = Transcript.load(tmp_path / "proof")
    assert transcript.grad is not None, "a run over several processes commits its gradient"
    assert transcript.root["env"]["update"]["canonical"], transcript.root["env"]["update"]
    for step in range(5):
        # Replayed here on one device: the state bit for bit (ok demands it), the
        # gradient within the bounds (its reductions ran over four devices).
        verdict = jax_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok, (step, verdict.reason, verdict.message)
        assert verdict.judgement in ("exact", "within_bounds"), verdict.judgement
    # The committed batch is the global one: 4 rows from each process.
    from zkdv.files import batch_path, read_batch

    assert read_batch(batch_path(tmp_path / "proof", 0)).shape[0] == 8
    # The platform's prover replays a step and a window from what rank 0 wrote.
    import provers

    verdict = provers.verify_challenge(tmp_path / "proof", 4)
    assert verdict.ok, (verdict.message, verdict.evidence)
    window = provers.verify_challenge(tmp_path / "proof", 0, through=2)
    assert window.ok, window


@pytest.mark.slow
@pytest.mark.timeout(600)  # _run_two gives its processes 300 s
def test_state_split_across_processes_is_rejected_on_every_process(tmp_path: Path) -> None:
    results = _run_two(tmp_path, "split")
    for result in results:
        message = str(result.get("error", ""))
        assert "split across processes" in message and "w1" in message, result


@pytest.mark.slow
@pytest.mark.timeout(600)  # _run_two gives its processes 300 s
def test_a_nudged_update_committed_by_rank_0_is_rejected_by_the_replay(tmp_path: Path) -> None:
    rank0, rank1 = _run_two(tmp_path, "forged")
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    # The processes trained alike; only what rank 0 committed after step 3 was changed.
    assert rank0["w2"] == rank1["w2"]
    for step in range(3):
        verdict = jax_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok, (step, verdict.reason, verdict.message)
    # 2**-20 is far inside the gradient bounds; the committed state must be exact.
    verdict = jax_replay.verify_challenge(tmp_path / "proof", 3)
    assert not verdict.ok and verdict.reason == "replay_mismatch", verdict
