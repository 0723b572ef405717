"""The common integration errors of the Flax tutorial raise messages that say what to do."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from jax_helpers import apply_fn, batches, init_params, loss, train_step

import zkdv
from zkdv.jax.contrib import TrainState


def test_no_transcript_update_when_the_step_uses_jax_jit(make_proof) -> None:
    proof = make_proof()
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.warns(UserWarning, match=r"not in the transcript"):
        step = jax.jit(train_step)
        for batch in batches(2):
            state = step(state, batch)
    with pytest.raises(
        zkdv.ZKDVError,
        match=r"No transcript update.*decorate the function containing apply_gradients",
    ):
        proof.close()


def test_proof_identity_error(make_proof) -> None:
    proof, other = make_proof(name="a"), make_proof(name="b")
    state = TrainState.create(
        proof=other, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.raises(zkdv.ZKDVError, match=r"Proof identity error.*exact instance"):
        proof.jit(train_step)(state, batches(1)[0])
    orphan = TrainState.create(apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1))
    with pytest.raises(zkdv.ZKDVError, match=r"Proof identity error: .* created with no proof"):
        proof.jit(train_step)(orphan, batches(1)[0])


def test_attested_program_already_registered(make_proof) -> None:
    proof = make_proof()
    proof.attest(lambda params, opt_state, batch, p, s: (0.0, 0.0))
    with pytest.raises(zkdv.ZKDVError, match=r"already registered"):
        proof.attest(lambda params, opt_state, batch, p, s: (0.0, 0.0))
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.raises(zkdv.ZKDVError, match=r"Remove the manual proof.attest function"):
        proof.jit(train_step)(state, batches(1)[0])


def test_static_argument_error(make_proof, tmp_path: Path) -> None:
    proof = make_proof()
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )

    @proof.jit(static_argnames=("scale",))
    def step(state, batch, scale):
        return state.apply_gradients(
            grads=jax.grad(lambda p: loss(state, p, batch * scale))(state.params)
        )

    data = batches(2)
    state = step(state, data[0], scale=2.0)
    state = step(state, data[1], scale=2.0)
    with pytest.raises(zkdv.ZKDVError, match=r"Static argument error.*Keep their values unchanged"):
        step(state, data[1], scale=3.0)
    proof.close()


def test_export_failure_says_to_pass_randomness_or_attest_apply_fn(make_proof) -> None:
    proof = make_proof()

    def host_apply(variables, x):  # a host callback cannot be exported
        out = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return apply_fn(variables, out)

    state = TrainState.create(
        proof=proof, apply_fn=host_apply, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.raises(zkdv.ZKDVError, match=r"Export or replay failure.*attest_apply_fn"):
        proof.jit(train_step)(state, batches(1)[0])
    fixed = make_proof(name="fixed")
    state = TrainState.create(
        proof=fixed,
        apply_fn=host_apply,
        attest_apply_fn=apply_fn,
        params=init_params(),
        tx=optax.adam(0.1),
    )
    step = fixed.jit(train_step)
    for batch in batches(3):
        state = step(state, batch)
    fixed.close()


def test_rolling_window_wider_than_the_packed_row(make_proof) -> None:
    proof = make_proof(window=100)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.raises(ValueError, match=r"rolling_window=100 exceeds .* 4 rows of 7 words"):
        proof.jit(train_step)(state, batches(1)[0])


def test_explicit_api_errors(make_proof) -> None:
    proof = make_proof()
    params = init_params()
    opt = optax.adam(0.1).init(params)

    @proof.jit(donate_argnums=(1,))
    def donates_opt_state(params, opt_state, batch):
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        transaction.update(deltas=params, params=params, opt_state=opt_state)
        return params

    proof.attest(
        lambda params, opt_state, batch, p, s: (
            zkdv.jax.index(params, p),
            zkdv.jax.index(opt_state, s),
        )
    )
    with pytest.raises(zkdv.ZKDVError, match=r"optimizer state cannot be donated"):
        donates_opt_state(params, opt, batches(1)[0])

    @proof.jit
    def no_transaction(params, batch):
        return params

    with pytest.raises(zkdv.ZKDVError, match=r"declared no transaction"):
        no_transaction(params, batches(1)[0])

    @proof.jit
    def no_update(params, opt_state, batch):
        zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        return params

    with pytest.raises(zkdv.ZKDVError, match=r"transaction.update\(deltas"):
        no_update(params, opt, batches(1)[0])

    with pytest.raises(TypeError, match=r"unexpected jax.jit options"):
        proof.jit(no_update, donate=True)


def test_explicit_api_without_attest(make_proof) -> None:
    proof = make_proof()
    params = init_params()

    @proof.jit
    def step(params, opt_state, batch):
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        transaction.update(deltas=params, params=params, opt_state=opt_state)
        return params

    with pytest.raises(zkdv.ZKDVError, match=r"register it with @proof.attest"):
        step(params, optax.sgd(0.1).init(params), batches(1)[0])


def test_lifecycle(tmp_path: Path) -> None:
    proof = zkdv.jax.ZKDV(tmp_path / "p")
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.1)
    )
    with pytest.raises(zkdv.ZKDVError, match=r"call proof.start"):
        proof.jit(train_step)(state, batches(1)[0])
    proof._states_created = 0
    proof.close()
    assert jnp.asarray(1) == 1
