"""``Transaction.update(..., grads=, tx=)``: a user's own update declared as an Optax one.

The step computes its update with its own code (Optax's, evaluated plainly, and then
``optax.apply_updates``) and declares the gradient and the transformation; the run
commits the gradient, and its state is the declared transformation's canonical update
(issue 56, item 3). The run is trained in a subprocess on XLA's SSE4.2 kernels (no fused
multiply-add: another kernel family than this process's) and on one core, and replayed
here: every step's gradient within the bounds, its state bit for bit; so is a run
sharded over eight CPU devices (a 4x2 mesh), replayed on one. A forger whose
committed post-update state is its own update rather than the declared one is rejected
at that step's record, naming the parameter; mistakes in the declaration fail the first
call with a message naming the field.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_helpers import apply_fn, batches, init_params

import zkdv
from provers import jax_replay
from provers.replay import Transcript, windows
from tests.processes import run_jax
from zkdv.verify import verify_transcript

HERE = str(Path(__file__).resolve().parent)  # jax_helpers.py's folder
STEPS = 6
FORGED_STEP = 4  # inside the window [3, 5]

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import jax, jax.numpy as jnp, optax, zkdv
    from jax_helpers import apply_fn, batches, init_params
    from zkdv.jax import forgery

    def train(path, forge):
        proof = zkdv.jax.ZKDV(
            path,
            zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
            replay_snapshot_interval=3,
        )
        proof.start(rolling_window=2, probe_ratio=0.5)
        tx = optax.adam(0.05)

        @proof.jit(donate_argnums=(0,))
        def step(params, opt_state, batch):
            transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
            grads = jax.grad(
                lambda p: jnp.mean((apply_fn({"params": p}, batch[:, :6]) - batch[:, 6]) ** 2)
            )(params)
            # The step's own update: Optax evaluated plainly.
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            transaction.update(
                deltas=updates, params=new_params, opt_state=new_opt_state, grads=grads, tx=tx
            )
            return new_params, new_opt_state

        params, opt_state = init_params(), tx.init(init_params())
        if forge:
            # A forger's own update (here the declared one's kernel w, 1 % larger, and its
            # v), committed at step 4 in place of the declared transformation's.
            def own(after):
                return after * 1.01 if after.ndim == 2 else after
            with forgery.own_update(int(sys.argv[3]), own):
                for batch in batches(int(sys.argv[4])):
                    params, opt_state = step(params, opt_state, batch)
                proof.close()
            return
        for batch in batches(int(sys.argv[4])):
            params, opt_state = step(params, opt_state, batch)
        proof.close()

    train(sys.argv[1] + "/honest", False)
    train(sys.argv[1] + "/forged", True)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("declared")
    script = where / "train.py"
    script.write_text(SCRIPT)
    run_jax(
        [script, where, HERE, FORGED_STEP, STEPS],
        folder=where,
        name="train",
        xla_flags="--xla_cpu_max_isa=SSE4_2",
        pythonpath=[Path(HERE).parents[3]],
        cpus=sorted(os.sched_getaffinity(0))[:1],
    )
    return where


@pytest.mark.slow
@pytest.mark.timeout(600)  # the training subprocess has 420 s
def test_a_declared_update_commits_its_gradient_and_replays_under_other_kernels(
    runs: Path,
) -> None:
    path = runs / "honest"
    report = verify_transcript(path)
    assert report.ok, report.summary()
    transcript = Transcript.load(path)
    assert transcript.grad is not None, "the declared update commits its gradient"
    assert transcript.root["env"]["update"]["canonical"] is True, transcript.root["env"]
    assert transcript.root["env"]["cpu_isa"] == "SSE4_2"
    assert not jax_replay.exact_environment(transcript.root)
    evidence = []
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last)
        # ok demands the state bit for bit; the gradient is judged within the bounds.
        assert verdict.ok, (first, verdict.reason, verdict.message)
        assert verdict.judgement == "within_bounds", verdict.judgement
        evidence += verdict.evidence
    assert [e.step for e in evidence] == list(range(STEPS))
    assert {e.state for e in evidence} == {"exact"}
    # No fused multiply-add there: the gradients differ, and the bounds, not equality,
    # pass them, while the state is the committed one bit for bit.
    assert not all(e.exact for e in evidence), "every step exact: no other kernels?"
    assert all(e.gradient is not None and e.gradient["margin"] < 1 for e in evidence)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the training subprocess has 420 s
def test_a_post_state_other_than_the_declared_update_is_rejected_at_its_step(
    runs: Path,
) -> None:
    path = runs / "forged"
    assert verify_transcript(path).ok  # its roots and probes agree with what it committed
    verdict = jax_replay.verify_challenge(path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    message = str(verdict.message)
    assert message.startswith(f"step {FORGED_STEP}: the optimizer applied to the committed"), (
        message
    )
    # Which record field, and which parameter (v, before w in the schema, is the declared
    # update's).
    assert "differs in post.p (parameters), first at parameter params['w']" in message, message
    assert jax_replay.verify_challenge(path, 0, through=2).ok


SHARDED = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax, zkdv
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    proof = zkdv.jax.ZKDV(
        sys.argv[1],
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(2)),
        replay_snapshot_interval=2,
    )
    proof.start(rolling_window=2, probe_ratio=0.5)
    tx = optax.adamw(0.01)

    def loss(p, batch):
        return jnp.mean((jnp.tanh(batch[:, :6] @ p["w"]) @ p["v"] - batch[:, 6]) ** 2)

    @proof.jit
    def step(params, opt_state, batch):
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(loss)(params, batch)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        transaction.update(
            deltas=updates, params=new_params, opt_state=new_state, grads=grads, tx=tx
        )
        return new_params, new_state

    def on(*spec):
        return NamedSharding(mesh, P(*spec))

    params = {
        "w": jax.device_put(jax.random.normal(jax.random.key(0), (6, 8)) * 0.3, on(None, "model")),
        "v": jax.device_put(jax.random.normal(jax.random.key(1), (8,)) * 0.3, on("model")),
    }
    opt_state = tx.init(params)
    # The optimizer state on the mesh too (its step count replicated), as the params.
    opt_state = jax.device_put(opt_state, jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else on(), opt_state))
    rng = np.random.default_rng(1)
    for _ in range(int(sys.argv[2])):
        batch = jnp.asarray(rng.standard_normal((8, 7)), jnp.float32)
        params, opt_state = step(params, opt_state, jax.device_put(batch, on("data")))
    proof.close()
    assert params["w"].sharding == on(None, "model"), params["w"].sharding
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_declared_update_sharded_over_devices_replays_on_one_device(tmp_path: Path) -> None:
    """Eight CPU devices, a 4x2 (data, model) mesh: the step commits the global gradient,
    the SDK's checks pass, and one device here replays every step, the state bit for
    bit."""
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    path = tmp_path / "proof"
    run_jax(
        [script, path, 4],
        folder=tmp_path,
        name="sharded",
        xla_flags="--xla_force_host_platform_device_count=8",
    )
    report = verify_transcript(path)
    assert report.ok, report.summary()
    transcript = Transcript.load(path)
    assert transcript.grad is not None
    assert transcript.root["schema"]["sharding"]["params"][0]["mesh"] == {"data": 4, "model": 2}
    evidence = []
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last)
        assert verdict.ok, (first, verdict.reason, verdict.message)
        assert verdict.judgement == "within_bounds", verdict.judgement
        evidence += verdict.evidence
    assert [(e.step, e.state) for e in evidence] == [(step, "exact") for step in range(4)]


def _loss(params: Any, batch: jax.Array) -> jax.Array:
    return jnp.mean((apply_fn({"params": params}, batch[:, :6]) - batch[:, 6]) ** 2)


def test_the_step_trains_on_the_declared_update(make_proof) -> None:
    """The values the step returns are the declared transformation's update, whatever the
    function's own update computed (here nothing but the old state)."""
    proof = make_proof()
    tx = optax.sgd(0.1)

    @proof.jit
    def step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(_loss)(params, batch)
        kept = jax.tree.map(lambda p: p * 1.0, params)
        transaction.update(
            deltas=jax.tree.map(jnp.zeros_like, params),
            params=kept,
            opt_state=opt_state,
            grads=grads,
            tx=tx,
        )
        return kept, opt_state

    params, opt_state = init_params(), tx.init(init_params())
    batch = batches(1)[0]
    new_params, _ = step(params, opt_state, batch)
    grads = jax.grad(_loss)(params, batch)
    expected = optax.apply_updates(params, tx.update(grads, opt_state, params)[0])
    leaves = zip(
        jax.tree.leaves(new_params), jax.tree.leaves(expected), jax.tree.leaves(params), strict=True
    )
    for got, want, before in leaves:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
        assert not np.array_equal(np.asarray(got), np.asarray(before))
    proof.close()
    assert verify_transcript(proof.path).root["schema"]["grad"]


def test_a_declared_transformation_of_another_state_fails_naming_the_field(make_proof) -> None:
    proof = make_proof()
    tx = optax.sgd(0.1)

    @proof.jit
    def step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(_loss)(params, batch)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        transaction.update(
            deltas=updates, params=new_params, opt_state=new_state, grads=grads, tx=optax.adam(0.1)
        )
        return new_params, new_state

    with pytest.raises(zkdv.ZKDVError, match=r"transaction.update\(tx=\).*opt_state= has"):
        step(init_params(), tx.init(init_params()), batches(1)[0])


def test_grads_and_tx_go_together() -> None:
    params = init_params()
    transaction = zkdv.jax.Transaction(batch=None, params=params, opt_state=())
    with pytest.raises(zkdv.ZKDVError, match="pass both or neither"):
        transaction.update(deltas=params, params=params, opt_state=(), grads=params)
    with pytest.raises(zkdv.ZKDVError, match="pass both or neither"):
        transaction.update(deltas=params, params=params, opt_state=(), tx=optax.sgd(0.1))
    # Outside proof.jit the complete declaration is a marker, as update() always was.
    transaction.update(deltas=params, params=params, opt_state=(), grads=params, tx=optax.sgd(0.1))


def test_a_declared_update_with_a_manual_attested_program_says_which_to_remove(
    make_proof,
) -> None:
    """Moving from ``update`` + ``proof.attest`` to ``update(grads=, tx=)``: the attested
    program is generated, and the message names the transaction, not a TrainState."""
    proof = make_proof()
    tx = optax.sgd(0.1)

    @proof.attest
    def attested(params: Any, opt_state: Any, batch: Any, p: Any, s: Any) -> Any:
        updates, new_state = tx.update(jax.grad(_loss)(params, batch), opt_state, params)
        return zkdv.jax.index(updates, p), zkdv.jax.index(new_state, s)

    @proof.jit
    def step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(_loss)(params, batch)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        transaction.update(
            deltas=updates, params=new_params, opt_state=new_state, grads=grads, tx=tx
        )
        return new_params, new_state

    with pytest.raises(zkdv.ZKDVError, match=r"the step's zkdv.jax.Transaction commits its"):
        step(init_params(), tx.init(init_params()), batches(1)[0])
