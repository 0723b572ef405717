"""Several updates per compiled call (``zkdv.jax.scan``), and accumulation that proves as is.

A TPU-style step scans K batches and updates the state once per batch. Every update is
a committed step with its own batch slice and its own committed gradient, and the loop
applies the canonical update; sampled checks and the platform replay run one update's
programs from a snapshot, which may fall inside a call, also under another kernel
environment than the training's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import recipes
from jax_helpers import FEATURES, apply_fn, assert_verifies, batches, init_params, loss

import provers
import zkdv
from provers import jax_replay
from provers.replay import Transcript, windows
from tests.processes import run_jax
from zkdv.files import batch_path, read_batch
from zkdv.jax.contrib import TrainState
from zkdv.verify import verify_transcript

CALLS = 4


def _body(carry: Any, batch: jax.Array) -> Any:
    """One update; the carry holds the state and a PRNG key split per update."""
    state, key = carry
    key, noise_key = jax.random.split(key)
    noisy = batch + 0.01 * jax.random.normal(noise_key, batch.shape)
    value, grads = jax.value_and_grad(lambda p: loss(state, p, noisy))(state.params)
    return (state.apply_gradients(grads=grads), key), value


def _steps(state: Any, xs: jax.Array, key: jax.Array, scale: jax.Array) -> Any:
    # The body closes over `scale`, an input of the step: it is committed with each
    # update's batch.
    def body(carry: Any, batch: jax.Array) -> Any:
        return _body(carry, batch * scale)

    (state, key), losses = zkdv.jax.scan(body, (state, key), xs)
    return state, key, losses


def _state(proof: zkdv.jax.ZKDV | None, tx: Any = None, **kwargs: Any) -> TrainState:
    return TrainState.create(
        proof=proof,
        apply_fn=apply_fn,
        params=init_params(),
        tx=tx if tx is not None else optax.adam(0.05),
        **kwargs,
    )


def _calls(k: int, calls: int = CALLS, seed: int = 1) -> list[jax.Array]:
    data = batches(k * calls, seed=seed)
    return [jnp.stack(data[c * k : (c + 1) * k]) for c in range(calls)]


def _train(proof: zkdv.jax.ZKDV, k: int, *, donate: bool = True, **state: Any) -> Any:
    step = proof.jit(_steps, donate_argnums=(0,) if donate else ())
    train_state, key = _state(proof, **state), jax.random.key(3)
    scale = jnp.float32(1.5)
    for xs in _calls(k):
        train_state, key, _ = step(train_state, xs, key, scale)
    proof.close()
    return train_state


def _replay_every_window(path: Path) -> None:
    transcript = Transcript.load(path)
    transition = jax_replay.load_transition(path)
    assert jax_replay.exact_environment(transcript.root)
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert [e.step for e in verdict.evidence] == list(range(first, last + 1))
        assert all(e.exact for e in verdict.evidence)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "interval", "reverse"),
    [(3, 4, False), (2, 3, False), (4, 3, True)],
    ids=["k3-snapshots-inside", "k2", "k4-reverse"],
)
def test_every_update_inside_the_scan_is_a_checked_step(
    make_proof, k: int, interval: int, reverse: bool
) -> None:
    proof = make_proof(interval=interval)
    body = _steps
    if reverse:

        def body(state: Any, xs: jax.Array, key: jax.Array, scale: jax.Array) -> Any:
            (state, key), losses = zkdv.jax.scan(
                lambda carry, batch: _body(carry, batch * scale), (state, key), xs, reverse=True
            )
            return state, key, losses

    step = proof.jit(body, donate_argnums=(0,))
    state, key, scale = _state(proof), jax.random.key(3), jnp.float32(1.5)
    reference = jax.jit(body)  # zkdv.jax.scan outside proof.jit is jax.lax.scan
    expected, expected_key = _state(None), jax.random.key(3)
    for xs in _calls(k):
        state, key, losses = step(state, xs, key, scale)
        expected, expected_key, expected_losses = reference(expected, xs, expected_key, scale)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    proof.close()
    assert int(state.step) == k * CALLS
    for got, want in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(expected.params), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (k * CALLS, k * CALLS)
    # Snapshots follow the interval, also where it falls inside a call.
    transcript = Transcript.load(proof.path)
    assert sorted(transcript.snapshots) == list(range(0, k * CALLS, interval))
    assert any(s % k for s in transcript.snapshots)
    _replay_every_window(proof.path)
    assert provers.verify_challenge(proof.path, k * CALLS - 1).ok


@pytest.mark.parametrize(
    ("policy", "bound"),
    [(zkdv.overlap.NEVER, 1), (zkdv.overlap.UNCHECKED, 2), (zkdv.overlap.ALWAYS, 2)],
)
def test_a_call_is_one_generation_under_every_overlap_policy(
    make_proof, policy: zkdv.overlap.Policy, bound: int
) -> None:
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(2), interval=4)
    state = _train(proof, 3, zkdv_overlap=policy)
    assert state.zkdv_overlap is policy
    # The K updates of a call hold one admission, retired with the last of them.
    assert 1 <= proof._queue.max_live <= bound
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (12, 6)


def test_a_donated_state_donates_only_its_parameters(make_proof) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0), interval=4)
    step = proof.jit(_steps, donate_argnums=(0,))
    state, key, scale = _state(proof), jax.random.key(3), jnp.float32(1.5)
    for call, xs in enumerate(_calls(3)):
        previous = state
        state, key, _ = step(state, xs, key, scale)
        if call > 0:
            # No commitment reads a call's final state (only its stacked outputs), so
            # the next call donates it without waiting for the commitments.
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(previous.params))
            assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(previous.opt_state))
    proof.close()
    assert_verifies(proof.path)


def test_each_update_commits_its_own_batch_slice(make_proof) -> None:
    k = 3
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0), interval=4)
    _train(proof, k)
    artifact = proof.artifact
    assert artifact is not None
    assert artifact.source == "zkdv.jax.contrib.TrainState in zkdv.jax.scan"
    # Each update commits its gradient, and the loop's update is the canonical one.
    assert artifact.commits and artifact.canonical
    assert [c["path"] for c in artifact.computed] == ["params:params['v']", "params:params['w']"]
    grads = sorted(p.name for p in (proof.path / "files").glob("grad-*"))
    assert len(grads) == k * CALLS
    layout = artifact.layout
    assert [(leaf.path, leaf.dtype, leaf.shape) for leaf in layout.leaves] == [
        ("xs", "float32", (4, FEATURES + 1)),
        ("carry[1]", "key<fry>", ()),
        ("closure[0]", "float32", ()),
    ]
    assert (layout.rows, layout.cols) == (4, FEATURES + 1 + 2 + 1)
    key = jax.random.key(3)
    for call, xs in enumerate(_calls(k)):
        for j in range(k):
            step = call * k + j
            batch = np.asarray(read_batch(batch_path(proof.path, step)))
            # The update's slice of xs, bit for bit, ...
            np.testing.assert_array_equal(batch[:, : FEATURES + 1].view(np.float32), xs[j])
            # ... the key it started from, and the closed-over scale, in every row.
            np.testing.assert_array_equal(batch[:, 7:9], np.tile(jax.random.key_data(key), (4, 1)))
            np.testing.assert_array_equal(batch[:, 9].view(np.float32), np.full(4, 1.5, np.float32))
            key, _ = jax.random.split(key)
    assert verify_transcript(proof.path).steps == k * CALLS


def test_a_sampled_check_replays_an_update_inside_a_call(make_proof) -> None:
    # K = 2 and a check every third step: steps 3 and 9 are second updates of a call.
    proof = make_proof(zkdv.SamplingPolicy.DEBUGCheckEvery(3), interval=4)
    _train(proof, 2)
    report = assert_verifies(proof.path)
    assert report.checks == 3
    from zkdv.records import iter_records

    checks = [r.data for r in iter_records(proof.path) if r.data.get("t") == "check"]
    assert [(c["i"], c["from"], c["replayed"]) for c in checks] == [(0, 0, 0), (3, 0, 3), (6, 4, 2)]
    assert all(c["ok"] for c in checks)


def test_python_scalars_in_the_carry_are_committed_per_update(make_proof) -> None:
    proof = make_proof(interval=3)

    @proof.jit(donate_argnums=(0,))
    def steps(state: Any, xs: jax.Array) -> Any:
        def body(carry: Any, batch: jax.Array) -> Any:
            state, total = carry
            value, grads = jax.value_and_grad(lambda p: loss(state, p, batch))(state.params)
            return (state.apply_gradients(grads=grads), total + value), value

        (state, _), losses = zkdv.jax.scan(body, (state, 0.0), xs)
        return state, losses

    state = _state(proof)
    losses = []
    for xs in _calls(2, 3):
        state, values = steps(state, xs)
        losses.extend(np.asarray(values).tolist())
    proof.close()
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (6, 6)
    layout = proof.artifact.layout  # type: ignore[union-attr]
    assert [(leaf.path, leaf.dtype) for leaf in layout.leaves][1] == ("carry[1]", "float32")
    # Each update's batch holds the running total it started from: 0 for the first
    # update of a call, the first update's loss for the second.
    started = [
        np.asarray(read_batch(batch_path(proof.path, step)))[:, FEATURES + 1].view(np.float32)
        for step in range(6)
    ]
    for step, column in enumerate(started):
        expected = 0.0 if step % 2 == 0 else losses[step - 1]
        np.testing.assert_allclose(column, np.full(4, expected, np.float32), rtol=1e-6)
    _replay_every_window(proof.path)


def test_attest_apply_fn_replaces_apply_fn_in_the_replayed_update(make_proof) -> None:
    def portable(variables: dict[str, Any], batch: jax.Array) -> jax.Array:
        params = variables["params"]
        return jnp.tanh(jnp.einsum("bf,fh->bh", batch, params["w"])) @ params["v"]

    proof = make_proof(interval=3)
    _train(proof, 2, attest_apply_fn=portable)
    assert_verifies(proof.path)

    def wrong(variables: dict[str, Any], batch: jax.Array) -> jax.Array:
        return 2.0 * apply_fn(variables, batch)

    forged = make_proof(interval=3, name="wrong")
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        _train(forged, 2, attest_apply_fn=wrong)
    # A sampled check compares one drawn coordinate of the update and one of the optimizer
    # state. Adam's first update is lr * sign(g) whatever the gradient's scale, and a small
    # second moment (0.001 g^2) sits inside the absolute tolerance: where the draw (it
    # follows the run's bits, so the machine) lands on such a pair, step 0 passes and a
    # later step's check catches the forgery (seen in CI: step 1).
    assert re.match(r"sampled check of step [0-5] failed", str(raised.value.__cause__))


def test_a_batch_replaced_after_commitment_inside_a_call_fails_the_check(
    make_proof, monkeypatch: pytest.MonkeyPatch
) -> None:
    proof = make_proof(interval=4)
    keep = proof._keep_batch

    def tampered(index: int, batch: np.ndarray) -> None:
        if index == 4:  # the second update of the third call
            batch = np.roll(batch, 1, axis=1)
        keep(index, batch)

    monkeypatch.setattr(proof, "_keep_batch", tampered)
    with pytest.raises(zkdv.ZKDVPoisonedError):
        _train(proof, 3)
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "sampled check of step 4 failed" in str(raised.value.__cause__)


def test_a_state_modified_between_calls_is_rejected_and_fails_replay(make_proof) -> None:
    proof = make_proof(interval=4)
    step = proof.jit(_steps, donate_argnums=(0,))
    state, key, scale = _state(proof), jax.random.key(3), jnp.float32(1.5)
    with pytest.raises(zkdv.ZKDVPoisonedError):
        for call, xs in enumerate(_calls(2)):
            if call == 2:
                state = state.replace(params=jax.tree.map(lambda x: x + 1e-3, state.params))
            state, key, _ = step(state, xs, key, scale)
        proof.close()
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "parameters passed to step 4 are not the state committed after step 3" in str(
        raised.value.__cause__
    )

    # A forger who disabled that check and the SDK's own checks, and edited the state
    # before step 6 (inside the window [4, 7]) where the probes cannot see it: the
    # platform's replay of the window fails at that step.
    forged = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0), interval=4, name="f")
    forged._verify_continuity = lambda index, host_pre: None  # type: ignore[method-assign]
    step = forged.jit(_steps, donate_argnums=(0,))
    state, key = _state(forged), jax.random.key(3)
    for call, xs in enumerate(_calls(2)):
        if call == 3:
            state = _invisible(forged, state)
        state, key, _ = step(state, xs, key, scale)
    forged.close()
    assert verify_transcript(forged.path).ok
    verdict = provers.verify_challenge(forged.path, 4, through=7)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 6:")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(4, True), (5, True), (6, False)]
    assert jax_replay.verify_challenge(forged.path, 0, through=3).ok


def _invisible(proof: zkdv.jax.ZKDV, state: Any) -> Any:
    """Change ``w`` only along directions its probe cannot see."""
    proof.join()
    probes = proof._core.probes  # type: ignore[union-attr]
    leaf = next(i for i, spec in enumerate(probes.specs) if spec.shape == (FEATURES, 8))
    matrix = probes.matrices[leaf].astype(np.float64)
    null = np.linalg.svd(matrix.T)[2][matrix.shape[1] :]
    change = np.random.default_rng(7).standard_normal((FEATURES, len(null))) @ null * 0.05
    params = dict(state.params)
    params["w"] = params["w"] + jnp.asarray(change, jnp.float32)
    return state.replace(params=params)


def test_scan_errors_say_what_to_do(make_proof) -> None:
    xs = _calls(2, 1)[0]

    def plain_scan(state: Any, xs: jax.Array, key: jax.Array) -> Any:
        (state, key), _ = jax.lax.scan(_body, (state, key), xs)
        return state

    proof = make_proof()
    with pytest.raises(zkdv.ZKDVError, match=r"replace jax.lax.scan with\s+zkdv.jax.scan"):
        proof.jit(plain_scan)(_state(proof), xs, jax.random.key(0))

    def closed_over(state: Any, xs: jax.Array) -> Any:
        def body(count: jax.Array, batch: jax.Array) -> Any:
            grads = jax.grad(lambda p: loss(state, p, batch))(state.params)
            state.apply_gradients(grads=grads)
            return count + 1, None

        return zkdv.jax.scan(body, jnp.int32(0), xs)[0]

    other = make_proof(name="other")
    with pytest.raises(zkdv.ZKDVError, match="must be part of the scan's carry"):
        other.jit(closed_over)(_state(other), xs)

    def not_returned(state: Any, xs: jax.Array) -> Any:
        def body(state: Any, batch: jax.Array) -> Any:
            grads = jax.grad(lambda p: loss(state, p, batch))(state.params)
            state.apply_gradients(grads=grads)
            return state, None

        return zkdv.jax.scan(body, state, xs)[0]

    third = make_proof(name="third")
    with pytest.raises(zkdv.ZKDVError, match="must return the state that apply_gradients"):
        third.jit(not_returned)(_state(third), xs)

    def explicit(params: Any, opt_state: Any, xs: jax.Array) -> Any:
        def body(carry: Any, batch: jax.Array) -> Any:
            params, opt_state = carry
            zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
            return carry, None

        return zkdv.jax.scan(body, (params, opt_state), xs)[0]

    device = make_proof(name="device", commitments="device")
    with pytest.raises(zkdv.ZKDVError, match=r"does not commit zkdv\.jax\.scan updates yet"):
        device.jit(_steps)(_state(device), xs, jax.random.key(0), jnp.float32(1.0))
    with pytest.raises(zkdv.ZKDVError, match="No transcript update"):
        device.close()

    fourth = make_proof(name="fourth")
    with pytest.raises(zkdv.ZKDVError, match=r"declared with zkdv\.jax\.Transaction inside a scan"):
        fourth.jit(explicit)(init_params(), optax.adam(0.1).init(init_params()), xs)
    fourth.close()
    for made in (proof, other, third):
        with pytest.raises(zkdv.ZKDVError, match="No transcript update"):
            made.close()
        assert not (made.path / "records.cborl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("scan", [jax.lax.scan, zkdv.jax.scan], ids=["lax", "zkdv"])
def test_gradient_accumulation_over_microbatches_proves(make_proof, scan: Any) -> None:
    """A scan that only accumulates gradients, with one update after it, is one step."""
    proof = make_proof(interval=2)

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, microbatches: jax.Array) -> Any:
        def accumulate(total: Any, batch: jax.Array) -> Any:
            grads = jax.grad(lambda p: loss(state, p, batch))(state.params)
            return jax.tree.map(jnp.add, total, grads), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        total, _ = scan(accumulate, zeros, microbatches)
        grads = jax.tree.map(lambda g: g / microbatches.shape[0], total)
        return state.apply_gradients(grads=grads)

    state = _state(proof)
    for microbatches in _calls(4, 3):
        state = step(state, microbatches)
    proof.close()
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (3, 3)
    assert proof.artifact is not None
    assert proof.artifact.layout.rows == 4  # one committed batch of 4 x 4 examples
    _replay_every_window(proof.path)


@pytest.mark.slow
def test_optax_multisteps_proves_through_train_state(make_proof) -> None:
    """optax.MultiSteps: an update every k calls, its accumulator in the optimizer state."""
    proof = make_proof(interval=4)
    tx = optax.MultiSteps(optax.adam(0.05), every_k_schedule=3)
    state = _state(proof, tx=tx)

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: jax.Array) -> Any:
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    initial = jax.tree.map(np.asarray, state.params)
    history = []
    for batch in batches(9):
        state = step(state, batch)
        history.append(jax.tree.map(np.asarray, state.params))
    proof.close()
    # Parameters move only on every third call; the accumulator is committed state.
    moved = [
        not all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        )
        for before, after in zip([initial, *history[:-1]], history, strict=True)
    ]
    assert moved == [False, False, True] * 3
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (9, 9)
    state_paths = [s["path"] for s in Transcript.load(proof.path).root["schema"]["opt_state"]]
    assert "opt_state.opt_state.acc_grads['w']" in state_paths
    assert "opt_state.opt_state.mini_step" in state_paths
    _replay_every_window(proof.path)


@pytest.mark.slow
def test_multisteps_inside_a_scan(make_proof) -> None:
    proof = make_proof(interval=3)
    _train(proof, 4, tx=optax.MultiSteps(optax.adam(0.05), every_k_schedule=2))
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (16, 16)
    _replay_every_window(proof.path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_scan_trained_under_another_kernel_environment_replays_with_the_state_exact(
    tmp_path: Path,
) -> None:
    """The ``scan`` recipe trained at SSE4_2 (no FMA) on one core, as a lab's machine that
    is not the platform's worker, replayed here: every update's gradient within a tenth
    of the bounds, every post-update state bit for bit."""
    steps = 8
    run_jax(
        [recipes.__file__, tmp_path, "scan", str(steps), "3"],
        folder=tmp_path,
        name="scan",
        xla_flags="--xla_cpu_max_isa=SSE4_2",
        pythonpath=[Path(__file__).resolve().parents[4], Path(__file__).parent],
        cpus=[min(os.sched_getaffinity(0))],
        timeout=800,
    )
    path = tmp_path / "scan-0"
    report = verify_transcript(path)  # the SDK's own sampled checks passed there
    assert report.ok and report.checks == 3, report.summary()
    root = report.root
    assert (root["env"]["cpu_isa"], root["env"]["threads"]) == ("SSE4_2", 1)
    assert root["env"]["update"]["canonical"] is True
    assert not jax_replay.exact_environment(root)
    transition = jax_replay.load_transition(path)
    verdicts = [
        jax_replay.verify_challenge(path, first, through=last, transition=transition)
        for first, last in windows(Transcript.load(path))
    ]
    assert all(v.ok for v in verdicts), [v.message for v in verdicts]
    evidence = [e for v in verdicts for e in v.evidence]
    assert [e.step for e in evidence] == list(range(steps))
    assert all(e.state == "exact" for e in evidence)
    assert max(e.gradient["margin"] for e in evidence) < 0.1
    # Without FMA the gradients differ: the bounds, not equality, pass them.
    assert not all(e.gradient["exact"] for e in evidence)
