"""The ZKDV README's examples run with the calls, arguments and defaults they show.

Each test is one block of the README (docs/seed-api.md maps them), written against the
same calls: the JAX quick start with its deprecated ``state_check_probability``, the two
forms of ``proof.jit``, the explicit transaction with ``proof.attest``, the lifecycle
settings, ``DEBUGCheckEvery``, and the Torch quick start (as written on CUDA, and on the
CPU). Every transcript they write verifies offline.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zkdv
from zkdv.records import iter_records
from zkdv.verify import verify_transcript

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
pytest.importorskip("flax")


def _verified(path: str | Path) -> Any:
    report = verify_transcript(Path(path))
    assert report.ok, report.summary()
    return report


def _root(path: str | Path) -> dict[str, Any]:
    return next(iter(iter_records(Path(path) / "records.cborl"))).data


def _quick_start_config() -> zkdv.ZKDVConfig:
    # The README's first statement: both probabilities, the state one deprecated.
    with pytest.warns(DeprecationWarning, match="state_check_probability"):
        return zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(
                state_check_probability=0.01,
                update_check_probability=0.01,
            ),
        )


def _apply_fn(variables: dict[str, Any], batch: Any) -> Any:
    return variables["params"] * batch


def test_the_jax_quick_start() -> None:
    config = _quick_start_config()
    proof = zkdv.jax.ZKDV("proof", config)
    proof.start(rolling_window=2, probe_ratio=0.01)
    state = zkdv.jax.contrib.TrainState.create(
        proof=proof,
        apply_fn=_apply_fn,
        params=jnp.arange(8, dtype=jnp.float32),
        tx=optax.adam(1e-3),
    )

    @proof.jit(donate_argnums=(0,))
    def train_step(state: Any, batch: Any) -> Any:
        def loss(params: Any) -> Any:
            predictions = state.apply_fn({"params": params}, batch)
            return jnp.mean(predictions)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    for _ in range(10):
        state = train_step(state, jnp.ones((8,), dtype=jnp.float32))
    proof.close()

    # "proof/records.cborl is the resulting transcript"; the root names the prover.
    report = _verified("proof")
    assert report.steps == 10 and int(state.step) == 10
    root = _root("proof")
    assert root["prover"] == "whitebox-jax"
    assert root["config"]["sampling"] == {"kind": "bernoulli", "p": 0.01}


def _state(proof: Any, width: int = 8) -> Any:
    return zkdv.jax.contrib.TrainState.create(
        proof=proof,
        apply_fn=_apply_fn,
        params=jnp.arange(width, dtype=jnp.float32),
        tx=optax.sgd(0.1),
    )


def _step(state: Any, batch: Any) -> Any:
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2))
    return state.apply_gradients(grads=grads(state.params))


def test_jit_as_a_decorator_with_options_and_as_a_call() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    decorated = zkdv.jax.ZKDV("decorated", zkdv.ZKDVConfig())
    decorated.start(rolling_window=2)

    @decorated.jit(in_shardings=replicated, out_shardings=replicated, donate_argnums=(0,))
    def train_step(state: Any, batch: Any) -> Any:
        return _step(state, batch)

    called = zkdv.jax.ZKDV("called", zkdv.ZKDVConfig())
    called.start(rolling_window=2)
    # "Equivalent": the same function passed to proof.jit as a call.
    step = called.jit(_step, donate_argnums=(0,))
    states = [_state(decorated), _state(called)]
    for _ in range(3):
        batch = jnp.ones((8,), dtype=jnp.float32)
        states = [train_step(states[0], batch), step(states[1], batch)]
    decorated.close()
    called.close()
    assert np.array_equal(states[0].params, states[1].params)
    assert _verified("decorated").steps == _verified("called").steps == 3


FEATURES = 6


def test_the_explicit_transaction_and_the_attested_program() -> None:
    proof = zkdv.jax.ZKDV(
        "proof", zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(2))
    )
    proof.start(rolling_window=2, probe_ratio=0.5)
    tx = optax.adam(1e-2)

    def loss(params: Any, batch: Any) -> Any:
        predictions = batch[:, :FEATURES] @ params["w"] + params["b"]
        return jnp.mean((predictions - batch[:, FEATURES]) ** 2)

    def transition(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any]:
        updates, opt_state_after = tx.update(jax.grad(loss)(params, batch), opt_state, params)
        return updates, opt_state_after

    # The fixed ABI: pre-update trees, the batch, two uint64 indices; two scalars out.
    @proof.attest
    def attested_step(
        params_before: Any,
        opt_state_before: Any,
        batch: Any,
        parameter_index: Any,
        optimizer_state_index: Any,
    ) -> tuple[Any, Any]:
        updates, opt_state_after = transition(params_before, opt_state_before, batch)
        return (
            zkdv.jax.index(updates, parameter_index),
            zkdv.jax.index(opt_state_after, optimizer_state_index),
        )

    @proof.jit(donate_argnums=(0,))
    def train_step(params: Any, opt_state: Any, batch: Any, overlap_policy: Any) -> Any:
        transaction = zkdv.jax.Transaction(
            batch=batch,
            params=params,
            opt_state=opt_state,
            overlap=overlap_policy,
        )
        updates, opt_state_after = transition(params, opt_state, batch)
        params_after = optax.apply_updates(params, updates)
        transaction.update(deltas=updates, params=params_after, opt_state=opt_state_after)
        return params_after, opt_state_after

    params = {"w": jnp.full((FEATURES,), 0.1), "b": jnp.zeros(())}
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    # "Choose the policy separately for every invocation": all three, in turn.
    policies = [zkdv.overlap.ALWAYS, zkdv.overlap.UNCHECKED, zkdv.overlap.NEVER] * 2
    for policy in policies:
        batch = jnp.asarray(rng.normal(size=(4, FEATURES + 1)), dtype=jnp.float32)
        params, opt_state = train_step(params, opt_state, batch, policy)
    proof.close()
    report = _verified("proof")
    assert report.steps == 6 and report.checks == 3


def test_the_lifecycle_configuration() -> None:
    with pytest.warns(DeprecationWarning, match="state_check_probability"):
        config = zkdv.ZKDVConfig(
            name="pretraining",
            sampling_policy=zkdv.SamplingPolicy(
                state_check_probability=0.01,
                update_check_probability=0.01,
            ),
        )
    proof = zkdv.jax.ZKDV(
        "proof",
        config,
        max_in_flight=2,
        replay_snapshot_interval=12,
    )
    proof.start(rolling_window=32, probe_ratio=0.01)
    state = _state(proof, width=32)
    step = proof.jit(_step, donate_argnums=(0,))
    # rolling_window must not exceed a batch row's packed width: rows of 32 float32 words.
    for _ in range(3):
        state = step(state, jnp.ones((4, 32), dtype=jnp.float32))
    proof.join()  # waits without closing: training may go on
    state = step(state, jnp.ones((4, 32), dtype=jnp.float32))
    proof.close()
    assert _verified("proof").steps == 4
    recorded = _root("proof")["config"]
    assert recorded["name"] == "pretraining"
    assert (recorded["rolling_window"], recorded["probe_ratio"]) == (32, 0.01)
    assert (recorded["snapshot_interval"], recorded["max_in_flight"]) == (12, 2)
    assert recorded["sampling"] == {"kind": "bernoulli", "p": 0.01}


def test_the_lifecycle_defaults() -> None:
    """The defaults the README states: two in flight, a snapshot every 12, 1% probes."""
    proof = zkdv.jax.ZKDV("proof", zkdv.ZKDVConfig())
    proof.start(rolling_window=2)
    state, step = _state(proof), proof.jit(_step)
    state = step(state, jnp.ones((8,), dtype=jnp.float32))
    proof.close()
    recorded = _root("proof")["config"]
    assert (recorded["snapshot_interval"], recorded["max_in_flight"]) == (12, 2)
    assert recorded["probe_ratio"] == 0.01
    assert recorded["sampling"] == {"kind": "bernoulli", "p": 0.01}


def test_debug_check_every_checks_every_nth_step() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented testing policy warns of nothing
        policy = zkdv.SamplingPolicy.DEBUGCheckEvery(3)
    proof = zkdv.jax.ZKDV("proof", zkdv.ZKDVConfig(sampling_policy=policy))
    proof.start(rolling_window=2)
    state, step = _state(proof), proof.jit(_step)
    for _ in range(7):
        state = step(state, jnp.ones((8,), dtype=jnp.float32))
    proof.close()
    report = _verified("proof")
    assert (report.steps, report.checks) == (7, 3)  # steps 0, 3 and 6
