"""Honest JAX training recipes, trained in-process or in a subprocess under another ISA.

Five recipes, each a function ``(proof, steps, seed)`` training under a started
``zkdv.jax.ZKDV`` (the seed draws the initial parameters and the order of the data):

* ``digits``: the Flax digits example (``examples/jax/digits.py``), Adam;
* ``batchstats``: a Flax classifier whose first ``Dense`` is followed by batch
  standardisation ``(h - h.mean(0)) / sqrt(h.var(0) + 1e-5)``, then a ``BatchNorm``
  whose ``batch_stats`` the step passes to ``apply_gradients`` (carried state), AdamW;
* ``lm``: the causal transformer LM recipe (``examples/jax/lm.py``, one block): warmup
  + cosine schedule, ``clip_by_global_norm``, two micro-batches accumulated inside the
  step, AdamW;
* ``scan`` (issue 56): the digits classifier trained two updates per compiled call by
  ``zkdv.jax.scan``, a PRNG key carried through the loop for input noise, AdamW;
* ``sharded-DxM`` (issue 56): an MLP with clipping and AdamW on a warmup-cosine schedule
  over eight devices (``--xla_force_host_platform_device_count=8``), its batch split
  over a ``data`` axis of D devices and its hidden layer over a ``model`` axis of M;
  XLA partitions the step (GSPMD).

``python recipes.py DIR NAME[,NAME...] STEPS CHECK_EVERY [SEED,...] [forge]`` trains every
named recipe with every seed (default 0) into ``DIR/NAME-SEED``, one process for all of
them (the tests run it under ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`` and on one core, as a
lab's machine that is not the platform's worker), and prints one JSON line per run.
``forge`` also trains each recipe from seed 0 into ``DIR/NAME-forged`` as a forger
would: no SDK checks, and step ``FORGED_STEP``'s committed gradient 1 % larger than the
one the optimizer applied (the replay must reject it).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zkdv
from zkdv.jax.contrib import TrainState
from zkdv.verify import verify_transcript

EXAMPLES = Path(__file__).resolve().parents[4] / "examples" / "jax"
INTERVAL = 4
#: The step whose committed gradient a forged run scales (``forge``).
FORGED_STEP = 5


def example(name: str) -> Any:
    """Import ``examples/jax/<name>.py`` as a module (its ``main()`` does not run)."""
    module = sys.modules.get(f"zkdv_jax_example_{name}")
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(
        f"zkdv_jax_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _shuffled(rows: np.ndarray, seed: int) -> np.ndarray:
    return rows if seed == 0 else np.random.default_rng(seed).permutation(rows)


def digits(proof: zkdv.jax.ZKDV, steps: int, seed: int = 0) -> None:
    module = example("digits")
    rows, _ = module.digit_rows()
    module.train(proof, _shuffled(rows, seed), steps, seed=seed)


class BatchStatClassifier(nn.Module):
    """Dense, batch standardisation, Dense, BatchNorm, Dense: ten classes of 64 pixels."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        h = nn.Dense(32)(x)
        # The mean subtraction makes the first bias's true gradient zero: what remains
        # is rounding noise, which Adam would amplify to a full +-lr step.
        h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        h = nn.Dense(32)(nn.relu(h))
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        return nn.Dense(10)(nn.relu(h))


class BatchStatState(TrainState):
    batch_stats: Any = struct.field(pytree_node=True)


def batchstats(proof: zkdv.jax.ZKDV, steps: int, seed: int = 0) -> None:
    rows, _ = example("digits").digit_rows()
    rows = _shuffled(rows, seed)
    model = BatchStatClassifier()
    variables = model.init(jax.random.key(seed), jnp.zeros((2, 64)), train=False)
    state = BatchStatState.create(
        proof=proof,
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adamw(3e-3, weight_decay=1e-4),
        batch_stats=variables["batch_stats"],
    )

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: jax.Array) -> Any:
        pixels = batch[:, :64].astype(jnp.float32) / 16.0
        labels = batch[:, 64].astype(jnp.int32)

        def loss(params: Any) -> tuple[jax.Array, Any]:
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                pixels,
                train=True,
                mutable=["batch_stats"],
            )
            value = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return value, updates

        grads, updates = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    for index in range(steps):
        state = step(state, jnp.asarray(rows[(index % 30) * 50 :][:50]))


def lm(proof: zkdv.jax.ZKDV, steps: int, seed: int = 0) -> None:
    # One block: the recipe whole, at a third of the compile time of the example's two.
    example("lm").train(proof, steps, blocks=1, seed=seed)


class DigitClassifier(nn.Module):
    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        return nn.Dense(10)(jax.nn.relu(nn.Dense(32)(pixels)))


def scan(proof: zkdv.jax.ZKDV, steps: int, seed: int = 0) -> None:
    """Two updates per ``proof.jit`` call, in a ``zkdv.jax.scan`` (``steps`` even)."""
    rows = _shuffled(example("digits").digit_rows()[0], seed)
    model = DigitClassifier()
    state = TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(seed), jnp.zeros((1, 64)))["params"],
        tx=optax.adamw(3e-3, weight_decay=1e-4),
    )

    def update(carry: Any, batch: jax.Array) -> Any:
        state, key = carry
        key, noise = jax.random.split(key)
        pixels = batch[:, :64].astype(jnp.float32) / 16.0
        pixels = pixels + 0.01 * jax.random.normal(noise, pixels.shape)
        labels = batch[:, 64].astype(jnp.int32)

        def loss(params: Any) -> jax.Array:
            logits = state.apply_fn({"params": params}, pixels)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return (state.apply_gradients(grads=jax.grad(loss)(state.params)), key), None

    @proof.jit(donate_argnums=(0,))
    def calls(state: Any, key: jax.Array, batches: jax.Array) -> Any:
        (state, key), _ = zkdv.jax.scan(update, (state, key), batches)
        return state, key

    key = jax.random.key(seed + 1)
    for index in range(steps // 2):
        batches = rows[(index % 15) * 100 :][:100].reshape(2, 50, 65)
        state, key = calls(state, key, jnp.asarray(batches))


def sharded(proof: zkdv.jax.ZKDV, steps: int, seed: int = 0, *, mesh: tuple[int, int]) -> bool:
    """Train on a ``data`` x ``model`` mesh of ``mesh`` devices; whether every parameter
    kept its layout through the steps."""
    assert jax.device_count() == 8, jax.devices()
    # Auto axes: XLA partitions the step (GSPMD), as in test_jax_multidevice.
    devices = jax.make_mesh(mesh, ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def shard(*spec: str | None) -> NamedSharding:
        return NamedSharding(devices, P(*spec))

    def apply_fn(variables: Any, x: jax.Array) -> jax.Array:
        p = variables["params"]
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    key1, key2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.device_put(jax.random.normal(key1, (12, 32)) * 0.3, shard(None, "model")),
        "b1": jax.device_put(jnp.zeros((32,)), shard("model")),
        "w2": jax.device_put(jax.random.normal(key2, (32, 4)) * 0.3, shard("model", None)),
    }
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 12)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.1))
    state = TrainState.create(proof=proof, apply_fn=apply_fn, params=params, tx=tx)

    def placed(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        return sharding if isinstance(sharding, NamedSharding) else shard()

    state = jax.device_put(state, jax.tree.map(placed, state))
    layouts = jax.tree.map(lambda x: x.sharding, state.params)

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            y = state.apply_fn({"params": p}, batch[:, :12])
            return jnp.mean((y - batch[:, 12:]) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rng = np.random.default_rng(1 + seed)
    for _ in range(steps):
        rows = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
        state = step(state, jax.device_put(rows, shard("data")))
    kept = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state.params, layouts)
    return all(jax.tree.leaves(kept))


#: The one-device recipes: what the cross-kernel tests and the ``tpu`` suite train.
RECIPES: dict[str, Callable[[zkdv.jax.ZKDV, int, int], object]] = {
    "digits": digits,
    "batchstats": batchstats,
    "lm": lm,
}
#: Updates inside a ``zkdv.jax.scan``: trained by ``test_jax_scan.py`` under another
#: kernel environment (not the ``tpu`` suite's recipes).
SCANNED: dict[str, Callable[[zkdv.jax.ZKDV, int, int], object]] = {"scan": scan}
#: The sharded recipe on each mesh: they need eight devices
#: (``--xla_force_host_platform_device_count=8``), so only the cross-hardware sweep
#: (``bench/cross_hardware.py``) and ``test_jax_sharded.py`` train them.
SHARDED: dict[str, Callable[[zkdv.jax.ZKDV, int, int], object]] = {
    f"sharded-{data}x{model}": functools.partial(sharded, mesh=(data, model))
    for data, model in ((8, 1), (4, 2), (2, 4))
}


def forge(proof: zkdv.jax.ZKDV, step: int = FORGED_STEP) -> None:
    """Commit 1.01 times the gradient step ``step``'s optimizer applied, as read back from
    the device (tests/provers/test_jax_replay.py forges the same way)."""
    fetch = proof.transfers.fetch

    def forged(index: int, kind: str, value: Any) -> Any:
        host = fetch(index, kind, value)
        if index != step or kind != "gradient":
            return host
        return [np.asarray(leaf) * np.float32(1.01) for leaf in host]

    proof.transfers.fetch = forged  # type: ignore[method-assign]


def train(
    name: str,
    path: Path,
    steps: int,
    policy: zkdv.SamplingPolicy | None = None,
    *,
    seed: int = 0,
    before: Callable[[zkdv.jax.ZKDV], None] | None = None,
) -> Path:
    """Train recipe ``name`` from ``seed`` into ``path``; ``before(proof)`` may patch the
    proof first."""
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            sampling_policy=policy or zkdv.SamplingPolicy(update_check_probability=0.0)
        ),
        replay_snapshot_interval=INTERVAL,
    )
    proof.start(rolling_window=2, probe_ratio=0.25)
    if before is not None:
        before(proof)
    {**RECIPES, **SCANNED, **SHARDED}[name](proof, steps, seed)
    proof.close()
    return path


def main() -> None:
    directory, names, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    seeds = [int(seed) for seed in (sys.argv[5] if len(sys.argv) > 5 else "0").split(",")]
    for name in names.split(","):
        if sys.argv[6:] == ["forge"]:
            policy = zkdv.SamplingPolicy(update_check_probability=0.0)
            train(name, Path(directory) / f"{name}-forged", steps, policy, before=forge)
        for seed in seeds:
            path = train(
                name,
                Path(directory) / f"{name}-{seed}",
                steps,
                zkdv.SamplingPolicy.DEBUGCheckEvery(every),
                seed=seed,
            )
            env = verify_transcript(path).root["env"]
            print(
                json.dumps(
                    {
                        "recipe": name,
                        "seed": seed,
                        "isa": env["cpu_isa"],
                        "threads": env["threads"],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
