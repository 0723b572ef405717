"""Committed gradients: what a JAX run commits, and honest runs replayed elsewhere.

The three recipes of ``recipes.py`` (the digits example, a batch-statistics classifier,
the LM recipe) are trained under five other (instruction set, cores) environments, each
recipe under at least one (``ZKDV_TEST_MATRIX=full``: two seeds each, ten runs per recipe),
one subprocess per environment, as a lab whose machine
is not the platform's worker, and replayed window by window here, on this machine's own
instruction set and cores: every window passes, within a tenth of the gradient bounds,
and no step is claimed exact where the instruction set has no FMA. The same recipes
trained here replay bit for bit. The forgeries of a committed gradient live in
``tests/provers/test_jax_replay.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import recipes
from jax_helpers import apply_fn, batches, init_params, loss, train_step

import zkdv
from provers import jax_replay
from provers.replay import Transcript, windows
from tests.matrix import cell_id, cells
from tests.processes import run_jax
from zkdv.config import GradientBounds
from zkdv.jax.contrib import TrainState
from zkdv.verify import verify_transcript

ROOT = Path(__file__).resolve().parents[4]
STEPS = 8
CHECK_EVERY = 3
#: What the cross-ISA replays must stay under: a tenth of the bounds (measured: below
#: 1%; docs/performance.md, "History: the JAX frontend", section 13).
MARGIN = 0.1


def _replay_windows(path: Path, artifact: Any = None) -> list[Any]:
    """Every window, replayed by the platform's prover; with ``artifact`` (the SDK's own,
    holding the programs the step compiled) instead of the proof's file."""
    transcript = Transcript.load(path)
    if artifact is None:
        transition = jax_replay.load_transition(path)
    else:
        transition = zkdv.jax.replay.transition(artifact, transcript.root)
    return [
        jax_replay.verify_challenge(path, first, through=last, transition=transition)
        for first, last in windows(transcript)
    ]


def _worst_margin(verdicts: list[Any]) -> float:
    return max(e.gradient["margin"] for v in verdicts for e in v.evidence)


#: (instruction set, cores) the runs train under: XLA CPU's bits depend on both, and
#: none is this process's pair (it replays on every core it may use, at its own ISA).
ENVIRONMENTS = [("SSE4_2", 1), ("SSE4_2", 2), ("AVX", 1), ("AVX", 2), ("AVX2", 1)]
RUNS = 2
#: Every (environment, recipe, seed) under ZKDV_TEST_MATRIX=full; else each environment
#: and each recipe (tests/matrix.py).
CELLS = cells(len(ENVIRONMENTS), list(recipes.RECIPES), RUNS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """Per environment, every recipe's runs (two seeds each), trained in one process on
    that instruction set and those cores (a process per run would spend most of the
    suite's time importing and compiling)."""
    done: dict[int, Path] = {}

    def runs_of(pair: int) -> Path:
        if pair not in done:
            isa, cores = ENVIRONMENTS[pair]
            directory = tmp_path_factory.mktemp(f"jax-{isa}-{cores}")
            cpus = sorted(os.sched_getaffinity(0))[:cores]
            names = sorted({name for p, name, _ in CELLS if p == pair})
            seeds = ",".join(sorted({str(RUNS * pair + run) for p, _, run in CELLS if p == pair}))
            run_jax(
                [recipes.__file__, directory, ",".join(names), str(STEPS), str(CHECK_EVERY), seeds],
                folder=directory,
                name="train",
                xla_flags=f"--xla_cpu_max_isa={isa}",
                pythonpath=[ROOT, Path(__file__).parent],
                cpus=cpus,
                timeout=900,
            )
            done[pair] = directory
        return done[pair]

    return runs_of


@pytest.mark.slow
@pytest.mark.parametrize(("pair", "name", "run"), CELLS, ids=map(cell_id, CELLS))
@pytest.mark.timeout(1200)  # the first test of an environment trains its runs, 900 s at most
def test_runs_trained_on_another_instruction_set_and_cores_replay_within_bounds(
    pair: int, name: str, run: int, trained: Callable[[int], Path]
) -> None:
    isa, cores = ENVIRONMENTS[pair]
    path = trained(pair) / f"{name}-{RUNS * pair + run}"
    # The SDK's own sampled checks passed there.
    report = verify_transcript(path)
    assert report.ok and report.checks == -(-STEPS // CHECK_EVERY), report.summary()
    root = report.root
    assert (root["env"]["cpu_isa"], root["env"]["threads"]) == (
        isa,
        min(cores, len(os.sched_getaffinity(0))),
    )
    assert f"--xla_cpu_max_isa={isa}" in root["env"]["xla_flags"]
    assert not jax_replay.exact_environment(root)
    verdicts = _replay_windows(path)
    for verdict in verdicts:
        assert verdict.ok, f"{name}: {verdict.message}"
    if isa in ("SSE4_2", "AVX"):
        # No fused multiply-add there: the gradients differ (a step may still land on the
        # same bits by chance), and the bounds, not equality, pass them.
        exact = [e.exact for v in verdicts for e in v.evidence]
        assert not all(exact), f"{name}: {sum(exact)} of {len(exact)} steps exact"
    assert [e.step for v in verdicts for e in v.evidence] == list(range(STEPS))
    assert _worst_margin(verdicts) < MARGIN, name


@pytest.mark.slow
def test_runs_trained_here_replay_bit_for_bit(tmp_path: Path) -> None:
    for name in recipes.RECIPES:
        proofs: list[zkdv.jax.ZKDV] = []
        path = recipes.train(
            name,
            tmp_path / name,
            STEPS,
            zkdv.SamplingPolicy.DEBUGCheckEvery(CHECK_EVERY),
            before=proofs.append,
        )
        report = verify_transcript(path)
        assert report.ok and report.checks == -(-STEPS // CHECK_EVERY), report.summary()
        root = report.root
        assert root["schema"]["grad"], name
        assert root["env"]["update"]["canonical"] is True, root["env"]["update"]
        assert root["env"]["precision"] == {"kind": "float32", "reasons": []}
        assert root["config"]["bounds"] == GradientBounds.default("float32").to_dict()
        assert jax_replay.exact_environment(root)
        # The committed bytes are the artifact the step ran (the file's digest is
        # checked by the other tests' loads): its compiled programs, shared.
        artifact = proofs[0].artifact
        assert artifact is not None
        assert (path / "program.jaxexport").read_bytes() == artifact.material
        verdicts = _replay_windows(path, artifact)
        assert all(v.ok for v in verdicts), [v.message for v in verdicts]
        # The same programs in the same environment: every step bit for bit.
        assert all(e.exact for v in verdicts for e in v.evidence), name
        assert _worst_margin(verdicts) == 0.0


def test_what_a_train_state_step_commits(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adamw(0.05)
    )
    assert isinstance(state.tx, zkdv.jax.CommittedOptimizer)
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(3):
        state = step(state, batch)
    proof.close()
    root = verify_transcript(tmp_path / "proof").root
    # One gradient leaf per parameter, named after it, with its dtype and shape.
    assert [(g["path"], g["shape"]) for g in root["schema"]["grad"]] == [
        ("params:params['v']", [8]),
        ("params:params['w']", [6, 8]),
    ]
    artifact = proof.artifact
    assert artifact is not None and artifact.commits and artifact.canonical
    assert artifact.source == "zkdv.jax.contrib.TrainState"
    env = root["env"]
    for key in jax_replay.EXACT_KEYS:
        assert key in env, key
    assert env["threads"] == len(os.sched_getaffinity(0))
    assert env["export_platforms"] == ["cpu"]
    files = sorted(p.name for p in (tmp_path / "proof" / "files").glob("grad-*"))
    assert files == ["grad-00000000.bin", "grad-00000001.bin", "grad-00000002.bin"]


def test_subnormal_parameters_replay_bit_for_bit(make_proof, tmp_path: Path) -> None:
    """XLA on a CPU flushes subnormal numbers to zero; NumPy, which subtracts the delta
    rows on both sides (the step's commit stage and the platform's replay), does not. A
    parameter holding subnormal values (here one the loss never reads: its update is
    zero, and XLA's update writes 0 over it) still replays bit for bit."""
    proof = make_proof(interval=2)
    params = {**init_params(), "idle": jnp.full((8,), 1e-39, jnp.float32)}
    state = TrainState.create(proof=proof, apply_fn=apply_fn, params=params, tx=optax.adam(0.05))
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(4):
        state = step(state, batch)
    # The update really went through a flush: what the platform's subtraction sees.
    assert np.all(np.asarray(state.params["idle"]) == 0.0)
    proof.close()
    verdicts = _replay_windows(tmp_path / "proof")
    assert all(v.ok for v in verdicts), [v.message for v in verdicts]
    assert all(e.exact for v in verdicts for e in v.evidence)


def test_the_update_matches_plain_optax_within_rounding(make_proof) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0))
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1))
    ours = TrainState.create(proof=proof, apply_fn=apply_fn, params=init_params(), tx=tx)
    plain = TrainState.create(apply_fn=apply_fn, params=init_params(), tx=tx)

    def step(state: Any, batch: jax.Array) -> Any:
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    proved, jitted = proof.jit(step), jax.jit(step)
    for batch in batches(4):
        ours, plain = proved(ours, batch), jitted(plain, batch)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    proof.close()


def _muon_like(learning_rate: float) -> optax.GradientTransformation:
    """An optimizer with a matrix product in its update: no canonical form."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        def orthogonal(g: jax.Array) -> jax.Array:
            return -learning_rate * (g @ g.T @ g if g.ndim == 2 else g)

        return jax.tree.map(orthogonal, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_an_optimizer_without_canonical_form_still_commits_its_gradient(
    make_proof, tmp_path: Path
) -> None:
    proof = make_proof(interval=2)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=_muon_like(0.05)
    )

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: jax.Array) -> Any:
        return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p, batch))(state.params))

    for batch in batches(4):
        state = step(state, batch)
    proof.close()
    root = verify_transcript(tmp_path / "proof").root
    assert root["schema"]["grad"]
    optimizer = root["env"]["update"]
    assert optimizer["canonical"] is False and "dot_general" in optimizer["reason"]
    transition = jax_replay.load_transition(tmp_path / "proof")
    assert transition.canonical is False
    for verdict in _replay_windows(tmp_path / "proof"):
        assert verdict.ok, verdict.message
        # The same environment still reproduces every bit.
        assert all(e.exact for e in verdict.evidence)


def test_a_hand_written_optax_loop_commits_through_transaction_apply(
    make_proof, tmp_path: Path
) -> None:
    proof = make_proof(interval=2)
    tx = optax.adam(0.05)

    @proof.jit(donate_argnums=(0,))
    def step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(
            lambda p: jnp.mean((apply_fn({"params": p}, batch[:, :6]) - batch[:, 6]) ** 2)
        )(params)
        return transaction.apply(tx, grads)

    params, opt_state = init_params(), tx.init(init_params())
    for batch in batches(4):
        params, opt_state = step(params, opt_state, batch)
    proof.close()
    root = verify_transcript(tmp_path / "proof").root
    assert root["schema"]["grad"] and proof.artifact is not None
    assert proof.artifact.source == "zkdv.jax.Transaction"
    for verdict in _replay_windows(tmp_path / "proof"):
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message
    # Outside proof.jit, Transaction.apply is the plain Optax update.
    plain = zkdv.jax.Transaction(batch=None, params=params, opt_state=opt_state)
    grads = jax.tree.map(jnp.ones_like, params)
    got = plain.apply(tx, grads)
    updates, expected_state = tx.update(grads, opt_state, params)
    expected = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((expected, expected_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_transaction_apply_needs_every_input_in_the_batch(make_proof) -> None:
    proof = make_proof()
    tx = optax.sgd(0.1)

    @proof.jit
    def step(params: Any, opt_state: Any, batch: jax.Array, scale: jax.Array) -> Any:
        transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
        grads = jax.grad(lambda p: scale * jnp.sum(p["v"] ** 2))(params)
        return transaction.apply(tx, grads)

    with pytest.raises(zkdv.ZKDVError, match="must be a leaf of the transaction's batch"):
        step(init_params(), tx.init(init_params()), batches(1)[0], jnp.float32(2.0))


def test_one_optimizer_update_per_step(make_proof) -> None:
    proof = make_proof()
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.sgd(0.1)
    )

    @proof.jit
    def step(state: Any, batch: jax.Array) -> Any:
        grads = jax.grad(lambda p: loss(state, p, batch))(state.params)
        state.tx.update(grads, state.opt_state, state.params)  # a second update
        return state.apply_gradients(grads=grads)

    with pytest.raises(zkdv.ZKDVError, match="applies its optimizer once"):
        step(state, batches(1)[0])


def test_the_wrapper_is_the_plain_update_outside_proof_jit() -> None:
    tx = optax.adamw(0.1)
    wrapped = zkdv.jax.optimizer(tx)
    assert zkdv.jax.optimizer(wrapped) is wrapped
    params = init_params()
    grads = jax.tree.map(jnp.ones_like, params)
    state = wrapped.init(params)
    for got, want in zip(
        jax.tree.leaves(jax.jit(wrapped.update)(grads, state, params)),
        jax.tree.leaves(jax.jit(tx.update)(grads, state, params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"optax\.GradientTransformation"):
        zkdv.jax.optimizer(object())  # type: ignore[arg-type]


def _root(**changes: Any) -> dict[str, Any]:
    env = {**zkdv.jax.replay.environment(), "process_count": 1, "export_platforms": ["cpu"]}
    env.update(changes)
    return {"env": env, "schema": {"grad": []}}


@pytest.mark.parametrize(
    ("change", "exact"),
    [
        ({}, True),
        ({"cpu_isa": "SSE4_2", "xla_flags": "--xla_cpu_max_isa=SSE4_2"}, False),
        ({"threads": 64}, False),
        ({"xla_flags": "--xla_cpu_enable_fast_math=true"}, False),
        ({"x64": True}, False),
        ({"matmul_precision": "bfloat16"}, False),
        ({"cpu_model": "another CPU"}, False),
        ({"jaxlib": "0.0.1"}, False),
        ({"export_platforms": ["cuda"]}, False),
        ({"process_count": 2}, False),
    ],
)
def test_exact_environment_compares_everything_that_changes_the_bits(
    change: dict[str, Any], exact: bool
) -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("the roots here are CPU roots")
    assert jax_replay.exact_environment(_root(**change)) is exact


def test_a_root_from_before_the_environment_was_recorded_is_never_exact() -> None:
    root = _root()
    del root["env"]["cpu_isa"]
    assert not jax_replay.exact_environment(root)
    # A run without committed gradients exported for several platforms ran another
    # program in training than its replay runs.
    root = _root(export_platforms=["cpu", "cuda"])
    del root["schema"]["grad"]
    assert not jax_replay.exact_environment(root)
    root["env"]["export_platforms"] = ["cpu"]
    assert jax_replay.exact_environment(root) is (jax.default_backend() == "cpu")


def test_reduced_precision_is_recorded_with_its_bounds(make_proof, tmp_path: Path) -> None:
    proof = make_proof(interval=2)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params())
    state = TrainState.create(proof=proof, apply_fn=apply_fn, params=params, tx=optax.adam(0.05))

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: jax.Array) -> Any:
        grads = jax.grad(lambda p: loss(state, p, batch.astype(jnp.bfloat16)))(state.params)
        return state.apply_gradients(grads=grads)

    for batch in batches(3):
        state = step(state, batch)
    proof.close()
    root = verify_transcript(tmp_path / "proof").root
    precision = root["env"]["precision"]
    assert precision["kind"] == "reduced"
    assert precision["reasons"][0] == "bfloat16 parameters"
    assert root["config"]["bounds"] == GradientBounds.default("reduced").to_dict()
    assert root["env"]["update"]["canonical"] is True
    for verdict in _replay_windows(tmp_path / "proof"):
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_default_matmul_precision_on_gpus_is_reduced() -> None:
    from zkdv.jax._export import precision

    def product(a: jax.Array) -> jax.Array:
        return a @ a

    jaxpr = jax.make_jaxpr(product)(jnp.ones((2, 2)))
    params = [jnp.ones((2, 2))]
    assert precision(jaxpr, params, "cpu") == {"kind": "float32", "reasons": []}
    gpu = precision(jaxpr, params, "cuda")
    assert gpu["kind"] == "reduced" and "TF32" in gpu["reasons"][0]
    with jax.default_matmul_precision("highest"):
        assert precision(jaxpr, params, "cuda")["kind"] == "float32"
    highest = jax.make_jaxpr(lambda a: jnp.matmul(a, a, precision="highest"))(jnp.ones((2, 2)))
    assert precision(highest, params, "cuda")["kind"] == "float32"
