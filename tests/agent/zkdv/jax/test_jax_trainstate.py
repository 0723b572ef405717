"""zkdv.jax.contrib.TrainState under proof.jit: honest runs, Flax parity, subclasses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from flax.training import train_state
from jax_helpers import apply_fn, assert_verifies, batches, init_params, loss, train_step

import zkdv
from zkdv.jax.artifact import Artifact
from zkdv.jax.contrib import TrainState
from zkdv.records import iter_records


def test_every_step_checked_from_snapshots_verifies(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(7):
        state = step(state, batch)
    proof.close()
    report = assert_verifies(tmp_path / "proof")
    assert (report.steps, report.checks, report.snapshots) == (7, 7, [0, 3, 6])
    root = report.root
    assert root["prover"] == "whitebox-jax"
    assert root["program"]["kind"] == "jax.export"
    checks = [
        r.data for r in iter_records(tmp_path / "proof" / "records.cborl") if r.data["t"] == "check"
    ]
    # A checked replay starts at the latest snapshot and replays at most N - 1 steps.
    assert [(c["from"], c["replayed"]) for c in checks] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (3, 0),
        (3, 1),
        (3, 2),
        (6, 0),
    ]
    # Every dynamic state leaf other than params is in optimizer-state continuity.
    paths = [leaf["path"] for leaf in root["schema"]["opt_state"]]
    assert paths[0] == "opt_state.step" and any(".mu" in p for p in paths)


def test_same_updates_as_plain_flax_under_jax_jit(make_proof) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0))
    ours = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    flax_state = train_state.TrainState.create(
        apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    plain = TrainState.create(apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05))
    proved = proof.jit(train_step)
    jitted = jax.jit(train_step)
    for batch in batches(4):
        ours = proved(ours, batch)
        flax_state = jitted(flax_state, batch)
        plain = jitted(plain, batch)
    for a, b, c in zip(
        jax.tree.leaves(ours.params),
        jax.tree.leaves(flax_state.params),
        jax.tree.leaves(plain.params),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(b, c)
    assert int(ours.step) == 4
    proof.close()


class BatchNormModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(jnp.tanh(x))[:, 0]


class ModelTrainState(TrainState):
    batch_stats: Any = struct.field(pytree_node=True)


def test_subclass_with_batch_stats_is_in_continuity(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    model = BatchNormModel()
    variables = model.init(jax.random.key(0), jnp.ones((4, 6)), train=False)
    state = ModelTrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.1, momentum=0.9),
        batch_stats=variables["batch_stats"],
    )

    @proof.jit(donate_argnums=(0,), static_argnames=("train",))
    def step(state, batch, train=True):
        def objective(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                batch[:, :6],
                train=train,
                mutable=["batch_stats"],
            )
            return jnp.mean((out - batch[:, 6]) ** 2), updates

        grads, updates = jax.grad(objective, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    before = jax.tree.map(np.array, state.batch_stats)
    for batch in batches(5):
        state = step(state, batch)
    proof.close()
    assert not np.allclose(jax.tree.leaves(before)[0], jax.tree.leaves(state.batch_stats)[0])
    report = assert_verifies(tmp_path / "proof")
    assert report.checks == 5
    paths = [leaf["path"] for leaf in report.root["schema"]["opt_state"]]
    assert any(p.startswith("opt_state.batch_stats") for p in paths)


def test_overwrite_with_gradient_params(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    params = {
        "params": {"w": jnp.ones((3,))},
        train_state.OVERWRITE_WITH_GRADIENT: {"scale": jnp.ones((1,))},
    }
    state = TrainState.create(proof=proof, apply_fn=None, params=params, tx=optax.sgd(0.1))

    @proof.jit
    def step(state, batch):
        grads = {
            "params": {"w": batch[0] * state.params["params"]["w"]},
            train_state.OVERWRITE_WITH_GRADIENT: {"scale": batch[1:2] * 2.0},
        }
        return state.apply_gradients(grads=grads)

    for value in (1.0, 2.0, 3.0):
        state = step(state, jnp.asarray([value, value + 0.5]))
    proof.close()
    np.testing.assert_allclose(state.params[train_state.OVERWRITE_WITH_GRADIENT]["scale"], [7.0])
    assert assert_verifies(tmp_path / "proof").checks == 3


def test_artifact_replays_a_check_from_the_files_alone(make_proof, tmp_path: Path) -> None:
    """What a server-side prover does: artifact + snapshot and batch files, no model code."""
    from zkdv.files import batch_path, read_batch, read_state, snapshot_path
    from zkdv.merkle import LeafSpec

    proof = make_proof(interval=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(5):
        state = step(state, batch)
    proof.close()
    root = tmp_path / "proof"
    records = [r.data for r in iter_records(root / "records.cborl")]
    schema, chunk = records[0]["schema"], records[0]["config"]["chunk_bytes"]
    artifact = Artifact.loads((root / "program.jaxexport").read_bytes())
    assert artifact.source == "zkdv.jax.contrib.TrainState"
    check = next(r for r in records if r["t"] == "check" and r["i"] == 4)
    trees = []
    for tree in ("params", "opt_state"):
        specs = [LeafSpec.from_dict(s) for s in schema[tree]]
        leaves, commitment = read_state(snapshot_path(root, 3, tree), specs, chunk)
        trees.append([a for _, a in leaves])
    snap = next(r for r in records if r["t"] == "snap" and r["i"] == 3)
    assert commitment.root == snap["roots"]["o"]
    replayed = artifact.replay(
        trees[0],
        trees[1],
        [read_batch(batch_path(root, i)) for i in (3, 4)],
        check["param"]["index"],
        check["state"]["index"],
    )
    assert replayed == (check["param"]["replayed"], check["state"]["replayed"])


def test_prng_key_and_mixed_dtype_inputs_are_packed_losslessly(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2, window=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.sgd(0.1)
    )

    @proof.jit
    def step(state, batch, key, tokens, scale):
        noisy = batch + jax.random.normal(key, batch.shape) * 0.01 * scale
        noisy = noisy + tokens.astype(jnp.float32)[:, None] * 1e-3
        grads = jax.grad(lambda p: loss(state, p, noisy))(state.params)
        return state.apply_gradients(grads=grads)

    for i, batch in enumerate(batches(4)):
        state = step(
            state, batch, jax.random.key(i), jnp.arange(4, dtype=jnp.int8), jnp.bfloat16(i)
        )
    proof.close()
    report = assert_verifies(tmp_path / "proof")
    layout = proof.artifact.layout
    assert [leaf.dtype for leaf in layout.leaves] == ["float32", "key<fry>", "int8", "bfloat16"]
    # Four examples per row; the key and the scalar are replicated in every row.
    assert (layout.rows, layout.cols) == (4, 7 + 2 + 1 + 1)
    assert [leaf.shared for leaf in layout.leaves] == [False, True, False, True]
    assert report.checks == 4


def test_batch_layout_roundtrip_is_bit_exact() -> None:
    from zkdv.jax._tree import BatchLayout

    values = [
        jnp.asarray([[1.5, -0.0], [np.nan, np.inf]], jnp.float32),
        jnp.asarray([[True], [False]]),
        jnp.asarray([[-3, 7], [120, -128]], jnp.int8),
        jnp.asarray([[1.25], [-2.5]], jnp.bfloat16),
        jnp.asarray([[65535], [7]], jnp.uint16),
        jnp.asarray(0.5, jnp.float16),  # not per-example: replicated in each row
    ]
    layout = BatchLayout.of([f"x{i}" for i in range(len(values))], values)
    assert (layout.rows, layout.cols) == (2, 8)
    packed = layout.pack(values)
    assert packed.dtype == jnp.uint32 and packed.shape == (2, 8)
    for original, restored in zip(values, layout.unpack(packed), strict=True):
        assert restored.dtype == original.dtype
        np.testing.assert_array_equal(
            np.asarray(original).reshape(-1).view(np.uint8),
            np.asarray(restored).reshape(-1).view(np.uint8),
        )
    assert BatchLayout.from_dict(layout.to_dict()) == layout
    key = jax.random.key(3)
    single = BatchLayout.of(["x", "key"], [jnp.arange(5, dtype=jnp.int32), key])
    assert (single.rows, single.cols) == (1, 7)  # no rank-2 input: one row
    restored = single.unpack(single.pack([jnp.arange(5, dtype=jnp.int32), key]))[1]
    np.testing.assert_array_equal(jax.random.key_data(restored), jax.random.key_data(key))
    big = BatchLayout.of(["x", "table"], [jnp.zeros((4, 3)), jnp.zeros((100,))])
    assert big.rows == 1  # a large input that is not per-example: one row


def test_flax_tutorial_flow_with_a_prng_key(make_proof, tmp_path: Path) -> None:
    """The DVBench tutorial's TrainState code, with the driver created directly."""
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(2), interval=2, window=4)

    class TinyClassifier(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            return nn.Dense(2)(tokens.astype(jnp.float32))

    model = TinyClassifier()
    params = model.init(jax.random.key(0), jnp.ones((1, 4), dtype=jnp.uint32))["params"]
    state = TrainState.create(proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    @proof.jit(donate_argnums=(0,))
    def train_step(state, batch, key):
        tokens = batch[:, :4]
        labels = batch[:, 4].astype(jnp.int32)
        keep = jax.random.bernoulli(key, 0.9, tokens.shape)

        def loss(params):
            logits = state.apply_fn({"params": params}, tokens * keep)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    batch = jnp.asarray(
        [[0, 0, 0, 1, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1], [1, 1, 1, 0, 1]], dtype=jnp.uint32
    )
    for step in range(6):
        state = train_step(state, batch, jax.random.key(step))
    proof.close()
    report = assert_verifies(tmp_path / "proof")
    assert (report.steps, report.checks) == (6, 3)
    layout = proof.artifact.layout
    assert (layout.rows, layout.cols) == (4, 5 + 2)  # one example per row, the key in each
