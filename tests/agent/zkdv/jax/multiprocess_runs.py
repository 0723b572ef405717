"""Two JAX processes of two CPU devices each (jax.distributed over gloo), rank 0 writing
the transcript: for the tests and the cross-hardware sweep.

:func:`train` starts both ranks of :data:`SCRIPT`: an MLP, Adam, five steps of 4 rows per
process (the seed draws the rows), the state replicated over the four devices. The
modes: ``replicated`` (honest, the SDK checking every second step); ``split`` (a weight
split across the processes, which the SDK refuses); ``forged`` (no SDK checks, and rank 0
commits step 3's update with one weight nudged by 2**-20).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.processes import start, wait_all

ROOT = Path(__file__).resolve().parents[4]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address, rank, path, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    seed = int(sys.argv[5])
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

    rng = np.random.default_rng(rank + 2 * seed)  # each process feeds its own rows
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


def train(
    folder: Path,
    mode: str,
    *,
    seed: int = 0,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> list[dict[str, object]]:
    """Both ranks' results, the transcript in ``folder/proof``; ``env`` is added to the
    processes' environment and ``prefix`` goes before their command (``taskset``)."""
    environment = {**os.environ, **(env or {})}
    flags = (env or {}).get("XLA_FLAGS", "")
    environment["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    environment["ZKDV_JAX_EXPORT_PLATFORMS"] = ""
    environment.pop("JAX_PLATFORMS", None)
    address = f"127.0.0.1:{_free_port()}"
    path = folder / "proof"
    # The two ranks wait for each other: neither may block on output the caller is not
    # reading yet, so both write to files (tests/processes.py).
    processes = [
        start(
            [*prefix, sys.executable, "-c", SCRIPT, address, str(rank), str(path), mode, str(seed)],
            folder=folder / f"{mode}-output",
            name=f"rank{rank}",
            merge=True,
            cwd=ROOT,
            env=environment,
        )
        for rank in (0, 1)
    ]
    wait_all(processes, timeout=300)
    results = []
    for process in processes:
        lines = [line for line in process.stdout().splitlines() if line.startswith("RESULT ")]
        if process.returncode != 0 or not lines:
            raise RuntimeError(process.tail())
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results
