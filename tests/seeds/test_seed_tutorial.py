"""The DVBench tutorial "Train a Flax model with TrainState", block by block, offline.

The tutorial talks to a platform; ``DVBENCH_MODE=offline`` runs the same calls with
nothing sent (the proof stays on disk for ``dvbench sync``), so these tests need no
server. tests/agent/dvbench/test_sdk_tutorial.py runs the tutorial's program,
examples/jax/proof_trainstate.py, against a live platform; the blocks about subclasses,
randomness, ``attest_apply_fn`` and the common errors are tests of the JAX frontend
(docs/seed-api.md names them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zkdv
from dvbench import Client
from zkdv.verify import verify_transcript

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
linen = pytest.importorskip("flax.linen")
serialization = pytest.importorskip("flax.serialization")

# The tutorial's placeholder; offline, nothing connects to it.
API_URL = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DVBENCH_BASE_URL", "DVBENCH_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DVBENCH_MODE", "offline")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("DVBENCH_CACHE_DIR", str(tmp_path / "cache"))


class TinyClassifier(linen.Module):
    @linen.compact
    def __call__(self, tokens: Any) -> Any:
        return linen.Dense(2)(tokens.astype(jnp.float32))


def _params(model: TinyClassifier) -> Any:
    return model.init(
        jax.random.key(0),
        jnp.ones((1, 4), dtype=jnp.uint32),
    )["params"]


def _train_step(state: Any, batch: Any) -> Any:
    tokens = batch[:, :4]
    labels = batch[:, 4].astype(jnp.int32)

    def loss(params: Any) -> Any:
        logits = state.apply_fn({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits,
            labels,
        ).mean()

    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)


def _batch() -> Any:
    return jnp.asarray(
        [
            [0, 0, 0, 1, 0],
            [0, 1, 0, 1, 0],
            [1, 0, 1, 0, 1],
            [1, 1, 1, 0, 1],
        ],
        dtype=jnp.uint32,
    )


def _verified(proof: Any, steps: int) -> None:
    report = verify_transcript(Path(proof.path))
    assert report.ok, report.summary()
    assert report.steps == steps
    assert report.root["prover"] == "whitebox-jax"


def test_the_tutorial_offline() -> None:
    # 2. Start a JAX proof, before the training state exists.
    client = Client(API_URL)
    experiment = client.experiment("your-name/jax-train-state")
    proof = experiment.proof(backend="jax")
    assert isinstance(proof, zkdv.jax.ZKDV)  # "the full zkdv.jax.ZKDV driver"
    proof.start(rolling_window=4, probe_ratio=0.01)

    # 3. The model and state: zkdv.jax.contrib.TrainState in place of Flax's.
    model = TinyClassifier()
    params = _params(model)
    state = zkdv.jax.contrib.TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=params,
        tx=optax.adam(1e-2),
    )
    assert (int(state.step), state.proof, state.zkdv_overlap) == (0, proof, zkdv.overlap.UNCHECKED)

    # 4. proof.jit in place of jax.jit, donating the state.
    train_step = proof.jit(donate_argnums=(0,))(_train_step)

    # 5. Train normally.
    batch = _batch()
    for _ in range(10):
        state = train_step(state, batch)

    # 6. Finish, save the checkpoint; finish() is safe to call more than once.
    proof.finish()
    proof.finish()
    Path("jax-checkpoint.msgpack").write_bytes(
        serialization.to_bytes(state.params),
    )
    client.close()

    assert int(state.step) == 10
    saved = serialization.from_bytes(params, Path("jax-checkpoint.msgpack").read_bytes())
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), saved, state.params))
    _verified(proof, 10)  # offline, the proof stays on disk for `dvbench sync`


def test_the_tutorial_config_overlap_and_ordinary_jax() -> None:
    client = Client(API_URL)
    experiment = client.experiment("your-name/jax-train-state")
    # 2. The configured form of the proof.
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(
            update_check_probability=0.01,
        ),
    )
    proof = experiment.proof(backend="jax", config=config)
    proof.start(rolling_window=4, probe_ratio=0.01)
    model = TinyClassifier()

    # "Choose an overlap policy": set zkdv_overlap when creating or replacing the state.
    state = zkdv.jax.contrib.TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=_params(model),
        tx=optax.adam(1e-2),
        zkdv_overlap=zkdv.overlap.NEVER,
    )
    train_step = proof.jit(_train_step)
    state = train_step(state, _batch())
    assert state.zkdv_overlap is zkdv.overlap.NEVER
    state = state.replace(zkdv_overlap=zkdv.overlap.ALWAYS)
    state = train_step(state, _batch())
    assert state.zkdv_overlap is zkdv.overlap.ALWAYS

    # "The state also works with jax.device_put and ordinary jax.jit": normal Flax
    # behaviour, and no update in the proof (a warning says so).
    placed = jax.device_put(state)
    with pytest.warns(UserWarning, match="not in the transcript"):
        plain = jax.jit(_train_step)(placed, _batch())
    assert int(plain.step) == int(state.step) + 1
    state = train_step(state, _batch())
    proof.finish()
    client.close()
    _verified(proof, 3)
