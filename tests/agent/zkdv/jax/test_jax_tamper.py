"""Deliberately wrong updates are caught by sampled checks and poison close()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_helpers import apply_fn, batches, init_params, loss

import zkdv
from zkdv.jax.contrib import TrainState
from zkdv.verify import verify_transcript


def _explicit(proof: zkdv.jax.ZKDV, *, production_lr: float, attested_lr: float) -> Any:
    def update(params, opt_state, batch, lr):
        grads = jax.grad(
            lambda p: jnp.mean((jnp.tanh(batch[:, :6] @ p["w"]) @ p["v"] - batch[:, 6]) ** 2)
        )(params)
        updates, new_opt = optax.sgd(lr, momentum=0.9).update(grads, opt_state, params)
        return updates, new_opt

    @proof.attest
    def attested(params, opt_state, batch, p, s):
        updates, new_opt = update(params, opt_state, batch, attested_lr)
        return zkdv.jax.index(updates, p), zkdv.jax.index(new_opt, s)

    @proof.jit(donate_argnums=(0,))
    def step(params, opt_state, batch):
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        updates, new_opt = update(params, opt_state, batch, production_lr)
        new_params = optax.apply_updates(params, updates)
        transaction.update(deltas=updates, params=new_params, opt_state=new_opt)
        return new_params, new_opt

    return step


def _run(step: Any, steps: int = 4, *, between: Any = None) -> None:
    params = init_params()
    opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    try:
        for index, batch in enumerate(batches(steps)):
            params, opt_state = step(params, opt_state, batch)
            if between is not None:
                params = between(index, params)
    except zkdv.ZKDVPoisonedError:
        pass  # a failed check poisons the next call as soon as it completes


def test_honest_explicit_run_verifies(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    _run(_explicit(proof, production_lr=0.1, attested_lr=0.1))
    proof.close()
    assert verify_transcript(tmp_path / "proof").checks == 4


def test_transition_that_differs_from_the_attested_program(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    _run(_explicit(proof, production_lr=0.2, attested_lr=0.1))
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert isinstance(raised.value.__cause__, zkdv.ZKDVVerificationError)
    assert "sampled check of step 0 failed" in str(raised.value.__cause__)
    report = verify_transcript(tmp_path / "proof")
    assert (report.ok, report.reason) == (False, "failed_check")


def test_batch_changed_after_commitment(make_proof, monkeypatch) -> None:
    proof = make_proof(interval=4)
    keep = proof._keep_batch

    def tampered(index: int, batch: np.ndarray) -> None:
        if index == 1:  # the data replayed is not the data the update consumed
            # Shift every column, so features and targets all differ: a one-bit edit of
            # one input moved some challenged coordinates by less than the tolerance
            # (Adam normalises updates), and the challenged coordinate is random.
            batch = np.roll(batch, 1, axis=1)
        keep(index, batch)

    monkeypatch.setattr(proof, "_keep_batch", tampered)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    @proof.jit
    def step(state, batch):
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    with pytest.raises(zkdv.ZKDVPoisonedError):
        for batch in batches(4):
            state = step(state, batch)
        proof.close()
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "step 1" in str(raised.value.__cause__) or "step 2" in str(raised.value.__cause__)


def test_parameters_modified_outside_the_step(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=3)
    bump = lambda index, params: (  # noqa: E731
        jax.tree.map(lambda x: x + 1e-3, params) if index == 1 else params
    )
    _run(_explicit(proof, production_lr=0.1, attested_lr=0.1), 4, between=bump)
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "parameters passed to step 2 are not the state committed after step 1" in str(
        raised.value.__cause__
    )


def test_train_state_params_replaced_between_steps(make_proof) -> None:
    proof = make_proof(interval=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    @proof.jit(donate_argnums=(0,))
    def step(state, batch):
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    data = batches(4)
    state = step(state, data[0])
    # An untracked edit of the state: same buffers for params, a new optimizer state.
    state = state.replace(opt_state=jax.tree.map(lambda x: x * 2, state.opt_state))
    with pytest.raises(zkdv.ZKDVPoisonedError):
        for batch in data[1:]:
            state = step(state, batch)
        proof.close()
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "optimizer state passed to step 1" in str(raised.value.__cause__)


def test_unchanged_state_rebuilt_between_steps_still_continues(make_proof, tmp_path: Path) -> None:
    """New array objects with the committed values prove continuity by hashing."""
    proof = make_proof(interval=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    @proof.jit
    def step(state, batch):
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    for index, batch in enumerate(batches(4)):
        state = step(state, batch)
        if index == 1:
            state = jax.tree.map(lambda x: jnp.asarray(np.array(x)), state)
    proof.close()
    assert verify_transcript(tmp_path / "proof").ok


def test_replays_respect_float_tolerance(make_proof, tmp_path: Path) -> None:
    """attest_apply_fn within the tolerance passes; beyond it, the check fails."""
    for name, scale, ok in (("close", 1 + 1e-6, True), ("far", 1.05, False)):
        proof = make_proof(interval=1, name=name, tolerance=zkdv.FloatTolerance(1e-6, 1e-3))
        scaled = lambda v, x, s=scale: apply_fn(v, x) * s  # noqa: E731
        state = TrainState.create(
            proof=proof,
            apply_fn=apply_fn,
            attest_apply_fn=scaled,
            params=init_params(),
            tx=optax.sgd(0.1),
        )

        @proof.jit
        def step(state, batch):
            return state.apply_gradients(
                grads=jax.grad(lambda p: loss(state, p, batch))(state.params)
            )

        if ok:
            for batch in batches(3):
                state = step(state, batch)
            proof.close()
            assert verify_transcript(tmp_path / name).checks == 3
        else:
            with pytest.raises(zkdv.ZKDVPoisonedError):
                for batch in batches(3):
                    state = step(state, batch)
                proof.close()
