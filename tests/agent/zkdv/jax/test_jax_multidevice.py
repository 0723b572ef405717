"""Four CPU devices (a subprocess with XLA_FLAGS): NamedSharding layouts are preserved."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.sources import AGENT_PYTHONPATH

ROOT = Path(__file__).resolve().parents[4]

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import zkdv
    from zkdv.jax.contrib import TrainState
    from zkdv.verify import verify_transcript

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.{axis},) * 2)
    shard = lambda *spec: NamedSharding(mesh, P(*spec))
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1), commitments="{commitments}"
    )
    proof = zkdv.jax.ZKDV(sys.argv[1], config, replay_snapshot_interval=2)
    proof.start(rolling_window=2)

    def apply_fn(variables, x):
        p = variables["params"]
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    params = {{
        "w1": jax.device_put(jnp.ones((8, 16)) * 0.1, shard(None, "model")),  # tensor parallel
        "w2": jax.device_put(jnp.ones((16,)) * 0.1, shard("model")),
    }}
    state = TrainState.create(proof=proof, apply_fn=apply_fn, params=params, tx=optax.adam(1e-2))
    # Place the whole state on the mesh: sharded parameters and their Adam moments keep
    # their layout, everything else (step, counts) is replicated.
    placement = lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else shard()
    state = jax.device_put(state, jax.tree.map(placement, state))
    layouts = {{k: v.sharding for k, v in state.params.items()}}
    opt_layouts = [x.sharding for x in jax.tree.leaves(state.opt_state)]

    @proof.jit(donate_argnums=(0,))
    def step(state, batch):
        def loss(p):
            y = state.apply_fn({{"params": p}}, batch[:, :8])
            return jnp.mean((y - batch[:, 8]) ** 2)
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = jax.device_put(jnp.asarray(rng.standard_normal((8, 9)), jnp.float32), shard("data"))
        state = step(state, batch)
        for name, leaf in state.params.items():
            assert leaf.sharding.is_equivalent_to(layouts[name], leaf.ndim), (name, leaf.sharding)
        for leaf, layout in zip(jax.tree.leaves(state.opt_state), opt_layouts):
            assert leaf.sharding.is_equivalent_to(layout, leaf.ndim), leaf.sharding
    proof.close()
    assert proof.commitments == ("host" if "{commitments}" == "auto" else "{commitments}")
    report = verify_transcript(sys.argv[1])
    assert report.ok, report.summary()
    assert (report.steps, report.checks) == (4, 4)
    sharding = report.root["schema"]["sharding"]["params"]
    assert sharding[0]["spec"] == [None, "model"] and sharding[0]["mesh"] == {{"data": 2, "model": 2}}
    print("ok", report.digest)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("commitments", ["auto", "device"])
@pytest.mark.timeout(600)  # its process has 300 s
def test_named_shardings_are_preserved_and_one_logical_update_is_committed(
    tmp_path: Path, commitments: str
) -> None:
    # "device": the chunk roots, probes and snapshots of sharded leaves, on the mesh.
    # Auto (GSPMD) mesh axes: the exported replay program is traced without a mesh, so
    # model code written for explicit-axis meshes (out_sharding=...) is out of scope.
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["PYTHONPATH"] = AGENT_PYTHONPATH
    script = tmp_path / "multidevice.py"
    script.write_text(SCRIPT.format(axis="Auto", commitments=commitments))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "proof")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.startswith("ok")
