"""Flax NNX steps under proof.jit: the loop of the Flax guides, with nnx.jit replaced.

The model has BatchNorm statistics and a Dropout RNG stream (a count and a key), the
optimizer is ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` and the step
updates ``nnx.MultiMetric`` metrics, as the Flax NNX MNIST tutorial's step does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax_helpers import assert_verifies

import provers
import zkdv
from provers import jax_replay
from provers.replay import Transcript, windows
from zkdv.files import batch_path
from zkdv.verify import verify_transcript

STEPS = 7


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = self.dropout(jax.nn.relu(self.norm(self.linear1(x))))
        return self.linear2(hidden)[:, 0]


def train_step(model: MLP, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: Any) -> Any:
    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((model(batch[:, :6]) - batch[:, 6]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    metrics.update(loss=loss)
    optimizer.update(model, grads)
    return loss


def _objects(seed: int = 0) -> tuple[MLP, nnx.Optimizer, nnx.MultiMetric]:
    model = MLP(nnx.Rngs(seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, optax.adamw(0.01), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def _batches(steps: int = STEPS, seed: int = 1) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((8, 7)), jnp.float32) for _ in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_flax_guide_loop_proves_with_proof_jit(make_proof, tmp_path: Path, seed: int) -> None:
    """Honest runs: every step checked, every window replayed exactly by the platform."""
    proof = make_proof(interval=3)
    model, optimizer, metrics = _objects(seed)
    step = proof.jit(train_step, donate_argnames=("model", "optimizer"))
    reference_model, reference_optimizer, reference_metrics = _objects(seed)
    reference = nnx.jit(train_step, donate_argnames=("model", "optimizer"))
    for batch in _batches(seed=seed):
        loss = step(model, optimizer, metrics, batch)
        expected = reference(reference_model, reference_optimizer, reference_metrics, batch)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(expected), rtol=1e-5, atol=1e-6)
    proof.close()
    # The objects were updated in place, as nnx.jit updates them.
    assert int(optimizer.step[...]) == STEPS
    assert int(model.dropout.rngs.count[...]) == STEPS  # type: ignore[union-attr]
    ours = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    theirs = jax.tree.leaves(nnx.state(reference_model))
    for (path, got), want in zip(ours, theirs, strict=True):
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        # The bias in front of BatchNorm: its true gradient is zero (the norm subtracts
        # the mean), so its computed gradient is rounding noise, which differs between
        # any two compiled programs (ours is the exported step, the reference nnx.jit's
        # own), and AdamW turns noise into steps of up to lr (0.01) either way; the
        # norm's running mean follows that bias.
        name = jax.tree_util.keystr(path)
        noisy = "['linear1']['bias']" in name or "['norm']['mean']" in name
        atol = 2 * 0.01 * STEPS if noisy else 1e-6
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-5, atol=atol, err_msg=name
        )
    np.testing.assert_allclose(
        float(metrics.compute()["loss"]), float(reference_metrics.compute()["loss"]), rtol=1e-5
    )
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (STEPS, STEPS)
    transcript = Transcript.load(proof.path)
    transition = jax_replay.load_transition(proof.path)
    assert jax_replay.exact_environment(transcript.root)
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(
            proof.path, first, through=last, transition=transition
        )
        assert verdict.ok, verdict.message
        assert all(evidence.exact for evidence in verdict.evidence)
    assert provers.verify_challenge(proof.path, STEPS - 1).ok


def test_what_an_nnx_step_commits(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=3)
    model, optimizer, metrics = _objects()
    step = proof.jit(train_step)
    data = _batches(2)
    for batch in data:
        step(model, optimizer, metrics, batch)
    proof.close()
    root = Transcript.load(proof.path).root
    params = [spec["path"] for spec in root["schema"]["params"]]
    state = [spec["path"] for spec in root["schema"]["opt_state"]]
    # Parameters: exactly the model's nnx.Param variables (the optimizer's wrt).
    assert params == [
        "params['linear1']['bias']",
        "params['linear1']['kernel']",
        "params['linear2']['bias']",
        "params['linear2']['kernel']",
        "params['norm']['bias']",
        "params['norm']['scale']",
    ]
    # Continuity: BatchNorm statistics, the Dropout stream's count and key (as its
    # uint32 key data), the optimizer's step and its Optax state.
    assert "opt_state['model']['norm']['mean']" in state
    assert "opt_state['model']['norm']['var']" in state
    assert "opt_state['model']['dropout']['rngs']['count']" in state
    key = root["schema"]["opt_state"][state.index("opt_state['model']['dropout']['rngs']['key']")]
    assert (key["dtype"], key["shape"]) == ("uint32", [2])
    assert "opt_state['optimizer']['step']" in state
    assert "opt_state['optimizer']['opt_state'][0]['mu']['linear1']['kernel']" in state
    assert not any("metrics" in path for path in state)
    # Committed each step: the gradient of every parameter, then the state the forward
    # pass wrote (the BatchNorm statistics, the Dropout stream; the optimizer's step and
    # Optax state are the canonical update's, replayed, not committed).
    computed = [spec["path"] for spec in root["schema"]["grad"]]
    assert computed[: len(params)] == [f"params:{path}" for path in params]
    carried = computed[len(params) :]
    assert "opt_state:opt_state['model']['norm']['mean']" in carried
    assert "opt_state:opt_state['model']['dropout']['rngs']['count']" in carried
    assert not any("['optimizer']" in path for path in carried)
    assert root["env"]["update"]["canonical"] is True
    # The batch: the data rows, with the metrics' running totals replicated in each.
    committed = np.fromfile(batch_path(proof.path, 1), dtype="<u4")
    assert committed.size > 0
    assert proof.artifact is not None
    assert proof.artifact.source == "flax.nnx.Optimizer"
    layout = proof.artifact.layout
    assert [leaf.path for leaf in layout.leaves][-1] == "args[3]"
    assert layout.rows == 8
    assert any("[2]" in leaf.path and leaf.shared for leaf in layout.leaves)


def test_donated_nnx_arguments_donate_only_parameters(make_proof) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0))
    model, optimizer, metrics = _objects()
    step = proof.jit(train_step, donate_argnames=("model", "optimizer"))
    for index, batch in enumerate(_batches(4)):
        kernel = model.linear1.kernel[...]
        mu = optimizer.opt_state[0].mu["linear1"]["kernel"][...]
        step(model, optimizer, metrics, batch)
        if index > 0:
            assert kernel.is_deleted()
            assert not mu.is_deleted()
    proof.close()


def _invisible(proof: zkdv.jax.ZKDV, model: MLP) -> None:
    """Change linear1's kernel only along directions its probe cannot see."""
    proof.join()
    probes = proof._core.probes  # type: ignore[union-attr]
    leaf = next(i for i, spec in enumerate(probes.specs) if spec.shape == (6, 16))
    matrix = probes.matrices[leaf].astype(np.float64)
    null = np.linalg.svd(matrix.T)[2][matrix.shape[1] :]
    change = np.random.default_rng(7).standard_normal((6, len(null))) @ null * 0.05
    model.linear1.kernel[...] = model.linear1.kernel[...] + jnp.asarray(change, jnp.float32)


def _forged_run(
    make_proof: Any, policy: zkdv.SamplingPolicy, edit: Any, *, bypass: bool, **config: Any
) -> zkdv.jax.ZKDV:
    proof = make_proof(policy, interval=3, **config)
    if bypass:  # a forger who disabled the frontend's own continuity check
        proof._verify_continuity = lambda index, host_pre: None
    model, optimizer, metrics = _objects()
    step = proof.jit(train_step, donate_argnames=("model", "optimizer"))
    try:
        for index, batch in enumerate(_batches()):
            if index == 4:
                edit(proof, model)
            step(model, optimizer, metrics, batch)
    except zkdv.ZKDVPoisonedError:
        pass  # a failed check poisons the next call
    return proof


def _bump(proof: zkdv.jax.ZKDV, model: MLP) -> None:
    model.linear2.bias[...] = model.linear2.bias[...] + 0.05


def test_parameter_changed_outside_the_step_is_rejected_by_the_frontend(make_proof) -> None:
    proof = _forged_run(make_proof, zkdv.SamplingPolicy.DEBUGCheckEvery(1), _bump, bypass=False)
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "parameters passed to step 4 are not the state committed after step 3" in str(
        raised.value.__cause__
    )


def test_parameter_changed_outside_the_step_fails_the_sampled_check(make_proof) -> None:
    # A check compares one sampled coordinate of its step. Within the default tolerance
    # (rel 1e-3) the edit's effect on that coordinate can be too small at step 4 (Adam
    # normalises updates): about one run in fifteen, step 5's check caught it instead.
    # Honest steps replay to within a last bit here, so rel 1e-5 tells them apart: step 4's
    # check failed in 50 runs out of 50. So tight, the edit's rounding in float32 can also
    # show in the probes (3 runs in 50), and the verifier names that first.
    proof = _forged_run(
        make_proof,
        zkdv.SamplingPolicy.DEBUGCheckEvery(1),
        _invisible,
        bypass=True,
        tolerance=zkdv.FloatTolerance(0.0, 1e-5),
    )
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert "sampled check of step 4 failed" in str(raised.value.__cause__)
    report = verify_transcript(proof.path)
    assert not report.ok
    assert report.reason in {"failed_check", "probe_discontinuity"}


def test_parameter_changed_outside_the_step_fails_the_platform_replay(make_proof) -> None:
    # No SDK checks: the forged run completes as a forger would submit it.
    proof = _forged_run(
        make_proof, zkdv.SamplingPolicy(update_check_probability=0.0), _invisible, bypass=True
    )
    proof.close()
    assert verify_transcript(proof.path).ok  # the forger kept every probe consistent
    transition = jax_replay.load_transition(proof.path)
    verdict = provers.verify_challenge(proof.path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    # The windows before the edit and after the next snapshot still replay.
    assert jax_replay.verify_challenge(proof.path, 0, through=2, transition=transition).ok
    assert jax_replay.verify_challenge(proof.path, 6, transition=transition).ok


def test_nnx_errors_say_what_to_do(make_proof) -> None:
    proof = make_proof()
    model, optimizer, _ = _objects()

    @proof.jit
    def no_update(model: MLP, batch: jax.Array) -> jax.Array:
        return jnp.mean(model(batch[:, :6]))

    with pytest.raises(zkdv.ZKDVError, match=r"call optimizer.update\(model, grads\)"):
        no_update(model, _batches(1)[0])

    other = make_proof(name="other")

    @other.jit
    def returns_model(model: MLP, optimizer: nnx.Optimizer, batch: jax.Array) -> Any:
        grads = nnx.grad(lambda m: jnp.mean(m(batch[:, :6]) ** 2))(model)
        optimizer.update(model, grads)
        return model

    with pytest.raises(zkdv.ZKDVError, match="not NNX objects"):
        returns_model(model, optimizer, _batches(1)[0])

    third = make_proof(name="third")

    @third.jit
    def in_a_scan(model: MLP, optimizer: nnx.Optimizer, batches: jax.Array) -> Any:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(carry: Any, batch: jax.Array) -> Any:
            model, optimizer = carry
            grads = nnx.grad(lambda m: jnp.mean(m(batch[:, :6]) ** 2))(model)
            optimizer.update(model, grads)
            return model, optimizer

        body((model, optimizer), batches)
        return jnp.zeros(())

    with pytest.raises(zkdv.ZKDVError, match="inside a JAX transformation"):
        in_a_scan(model, optimizer, jnp.stack(_batches(2)))

    fourth = make_proof(name="fourth")

    @fourth.jit
    def twice(model: MLP, same: MLP, optimizer: nnx.Optimizer, batch: jax.Array) -> Any:
        grads = nnx.grad(lambda m: jnp.mean(m(batch[:, :6]) ** 2))(model)
        optimizer.update(model, grads)
        return jnp.zeros(())

    with pytest.raises(zkdv.ZKDVError, match=r"'model' and 'same' of this proof\.jit step share"):
        twice(model, model, optimizer, _batches(1)[0])


def test_an_nnx_step_commits_on_the_device_path_too(make_proof) -> None:
    """The device commitment path (issue 18) hashes the same NNX state leaves."""
    proof = make_proof(interval=2, commitments="device")
    model, optimizer, metrics = _objects()
    step = proof.jit(train_step, donate_argnames=("model", "optimizer"))
    for batch in _batches(3):
        step(model, optimizer, metrics, batch)
    proof.close()
    assert proof.commitments == "device"
    report = assert_verifies(proof.path)
    assert (report.steps, report.checks) == (3, 3)
    transcript = Transcript.load(proof.path)
    for first, last in windows(transcript):
        assert jax_replay.verify_challenge(proof.path, first, through=last).ok


def test_a_parameter_changed_after_the_update_is_refused(make_proof) -> None:
    """The platform replays the update from the committed gradient: a parameter the step
    writes afterwards would not be reproduced, so such a step is refused at once."""
    proof = make_proof()
    model, optimizer, metrics = _objects()

    def projected(model: MLP, optimizer: nnx.Optimizer, metrics: Any, batch: Any) -> Any:
        loss = train_step(model, optimizer, metrics, batch)
        model.linear2.bias[...] = jnp.clip(model.linear2.bias[...], -0.1, 0.1)
        return loss

    with pytest.raises(zkdv.ZKDVError, match="as its optimizer update wrote it"):
        proof.jit(projected)(model, optimizer, metrics, _batches(1)[0])
