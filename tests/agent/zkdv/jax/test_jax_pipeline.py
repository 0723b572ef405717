"""Overlap policies, donation and the pipeline's bounded memory."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_helpers import apply_fn, assert_verifies, batches, init_params, train_step

import zkdv
from zkdv.jax.contrib import TrainState


@pytest.mark.parametrize(
    ("policy", "bound"),
    [(zkdv.overlap.NEVER, 1), (zkdv.overlap.UNCHECKED, 2), (zkdv.overlap.ALWAYS, 2)],
)
def test_overlap_policies_bound_live_generations(make_proof, tmp_path: Path, policy, bound) -> None:
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(2), interval=4)
    state = TrainState.create(
        proof=proof,
        apply_fn=apply_fn,
        params=init_params(),
        tx=optax.adam(0.05),
        zkdv_overlap=policy,
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(10):
        state = step(state, batch)
        assert state.zkdv_overlap is policy  # the returned state keeps its policy
    proof.close()
    assert 1 <= proof._queue.max_live <= bound
    assert assert_verifies(tmp_path / "proof").checks == 5


def test_policy_changes_per_invocation_without_retracing(make_proof, tmp_path: Path) -> None:
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(3), interval=3)
    traces = []
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )

    @proof.jit
    def step(state, batch):
        traces.append(1)
        return train_step(state, batch)

    policies = [zkdv.overlap.NEVER, zkdv.overlap.ALWAYS, zkdv.overlap.UNCHECKED] * 3
    state = step(state, batches(1)[0])
    first = len(traces)
    for policy, batch in zip(policies, batches(9, seed=3), strict=True):
        state = step(state.replace(zkdv_overlap=policy), batch)
    assert len(traces) == first  # no retrace for a changed overlap policy
    proof.close()
    assert_verifies(tmp_path / "proof")


def test_donated_train_state_donates_only_parameters(make_proof) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0))
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(5):
        previous = state
        buffers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state.params)]
        state = step(state, batch)
        if int(state.step) > 1:
            # The barrier released every host view before the step, so JAX really
            # donated the parameter buffers; optimizer history stays available.
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(previous.params))
            assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(previous.opt_state))
            # The apply program wrote the post-update parameters into them (docs/jax.md 6).
            after = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state.params)]
            assert after == buffers
    proof.close()


def test_snapshots_and_batches_are_dropped_once_their_checks_are_done(
    make_proof, tmp_path: Path
) -> None:
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(5), interval=3)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(20):
        state = step(state, batch)
    proof.join()
    assert len(proof._snapshots) <= 2
    assert len(proof._batches) <= 2 * 3
    proof.close()
    report = assert_verifies(tmp_path / "proof")
    assert report.checks == 4 and report.snapshots == list(range(0, 20, 3))


def test_flops_and_tokens_are_recorded(make_proof, tmp_path: Path) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0))
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step)
    for batch in batches(3):
        state = step(state, batch)
    proof.close()
    report = assert_verifies(tmp_path / "proof")
    assert report.flops > 0
    # token_unit "examples" (the default): each batch's 4 rows, not its 4 x 7 words.
    assert report.root["config"]["token_unit"] == "examples"
    assert report.tokens == 3 * 4


def test_donation_is_memory_safe_while_a_view_exists() -> None:
    """The fact the barrier relies on: JAX 0.10 skips donation while a host view lives."""
    x = jnp.arange(1024, dtype=jnp.float32)
    view = np.asarray(x)
    y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    assert not x.is_deleted() and view[3] == 3.0 and float(y[3]) == 6.0
    del view
    z = jax.jit(lambda a: a * 2, donate_argnums=0)(y)
    assert y.is_deleted() and float(z[3]) == 12.0


def test_a_normal_loop_never_copies_the_state_after_the_first_step(make_proof, monkeypatch) -> None:
    """Continuity by identity: the inputs are the previous outputs, nothing is re-read."""
    import zkdv.jax._driver as driver

    copies = []
    original = driver._host_copy
    monkeypatch.setattr(driver, "_host_copy", lambda leaves: copies.append(1) or original(leaves))
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0), interval=2)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(6):
        state = step(state, batch)
    proof.close()
    assert len(copies) == 1  # the initial state
