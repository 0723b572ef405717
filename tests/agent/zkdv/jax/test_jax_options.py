"""proof.jit and proof.attest accept every jax.jit option; zkdv.jax.index."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import SingleDeviceSharding
from jax_helpers import apply_fn, assert_verifies, batches, init_params, loss

import zkdv
from zkdv.jax.contrib import TrainState


def test_every_jax_jit_option_is_accepted(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    device = jax.devices()[0]
    single = SingleDeviceSharding(device)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    @proof.jit(
        in_shardings=(single, single),
        out_shardings=(single, None),
        static_argnums=(2,),
        static_argnames=("mode",),
        donate_argnames=("state",),
        keep_unused=True,
        inline=False,
        compiler_options={},
    )
    def step(state, batch, scale, mode="train", unused=None):
        value, grads = jax.value_and_grad(lambda p: loss(state, p, batch * scale))(state.params)
        return state.apply_gradients(grads=grads), {"loss": value, "mode": mode == "train"}

    for batch in batches(3):
        state, metrics = step(state, batch, 1.0, mode="train", unused=jnp.zeros(2))
        assert metrics["loss"].shape == () and bool(metrics["mode"])
    assert all(leaf.sharding == single for leaf in jax.tree.leaves(state))
    proof.close()
    assert_verifies(tmp_path / "proof")


@pytest.mark.filterwarnings("ignore:backend and device argument:DeprecationWarning")
def test_decorator_callable_device_and_backend_forms(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=1)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    def body(state, batch):
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    step = proof.jit(body, backend="cpu", device=None)
    for batch in batches(2):
        state = step(state, batch)
    proof.close()
    assert_verifies(tmp_path / "proof")
    other = make_proof(name="decorated", interval=1)
    s2 = TrainState.create(
        proof=other, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    decorated = other.jit(body)
    assert decorated.__name__ == "body"
    s2 = decorated(s2, batches(1)[0])
    other.close()


def test_attest_options_and_ignored_out_shardings(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=1)
    tx = optax.sgd(0.1)

    def update(params, opt_state, batch):
        grads = jax.grad(
            lambda p: jnp.mean((jnp.tanh(batch[:, :6] @ p["w"]) @ p["v"] - batch[:, 6]) ** 2)
        )(params)
        return tx.update(grads, opt_state, params)

    with pytest.warns(UserWarning, match="ignores out_shardings"):

        @proof.attest(out_shardings=None, inline=True, keep_unused=True, compiler_options={})
        def attested(params, opt_state, batch, p, s):
            updates, new_opt = update(params, opt_state, batch)
            return zkdv.jax.index(updates, p), zkdv.jax.index(new_opt, s)

    @proof.jit(donate_argnums=0)
    def step(params, opt_state, batch):
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        updates, new_opt = update(params, opt_state, batch)
        new_params = optax.apply_updates(params, updates)
        transaction.update(deltas=updates, params=new_params, opt_state=new_opt)
        return new_params, new_opt

    params = init_params()
    opt_state = tx.init(params)
    for batch in batches(3):
        params, opt_state = step(params, opt_state, batch)
    proof.close()
    assert assert_verifies(tmp_path / "proof").checks == 3


def test_index_selects_across_pytrees_without_concatenating() -> None:
    tree = {
        "a": jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
        "b": (jnp.asarray(7, jnp.int32), jnp.asarray([8.5, 9.5], jnp.bfloat16)),
        "c": jnp.zeros((0,)),
    }
    flat = np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(tree)])
    select = jax.jit(zkdv.jax.index)
    for i in range(len(flat)):
        assert float(select(tree, i)) == flat[i]
    with jax.enable_x64(True):
        assert float(zkdv.jax.index(tree, np.uint64(2**40))) == 0.0
        assert zkdv.jax.index(tree, np.uint64(3)).dtype == jnp.float32
    jaxpr = str(jax.make_jaxpr(zkdv.jax.index)(tree, 1))
    assert "concatenate" not in jaxpr
