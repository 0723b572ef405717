"""The whitebox-jax prover on real zkdv.jax runs: honest runs replay bit for bit, forgeries fail.

Each run is made once per module (a contrib ``TrainState`` with Optax AdamW, a small
Flax MLP, ``replay_snapshot_interval=3``, 8 steps, no SDK-side checks so that forged
runs complete as a forger would submit them); tests that damage files work on copies.
The runs commit their gradients: the forgeries include a committed gradient that is not
the one the step applied, and a batch other than the one the step trained on.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from tests.sources import AGENT_PYTHONPATH

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("flax")

import cbor2  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402

import provers  # noqa: E402
import zkdv  # noqa: E402
from provers import jax_replay  # noqa: E402
from provers.replay import Transcript, windows  # noqa: E402
from zkdv.files import batch_path, gradient_path, snapshot_path  # noqa: E402
from zkdv.jax import forgery  # noqa: E402
from zkdv.jax.contrib import TrainState  # noqa: E402
from zkdv.replay import ReplayError  # noqa: E402
from zkdv.verify import verify_transcript  # noqa: E402

STEPS = 8
FORGED_STEP = 4  # inside the window [3, 5]
LEARNING_RATE = 0.01


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(jnp.tanh(nn.Dense(16)(x)))[:, 0]


def _step(state: Any, batch: jax.Array) -> Any:
    def loss(params: Any) -> jax.Array:
        return jnp.mean((state.apply_fn({"params": params}, batch[:, :6]) - batch[:, 6]) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


Between = Callable[[zkdv.jax.ZKDV, Any], Any]


def _train(
    path: Path,
    *,
    between: Between | None = None,
    bypass: bool = False,
    commit: Callable[[str, Any], Any] | None = None,
    gradient_files: str = "auto",
) -> Path:
    """Train 8 steps; ``between(proof, state)`` edits the state before step 4.

    ``bypass`` plays a forger who disabled the frontend's own continuity check;
    ``commit(kind, host values)`` one who changes what step 4 commits (its ``batch`` or
    its ``gradient``, as read back from the device) after the step ran.
    """
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0),
            gradient_files=gradient_files,
        ),
        replay_snapshot_interval=3,
    )
    proof.start(rolling_window=2, probe_ratio=0.5)
    if bypass:
        proof._verify_continuity = lambda index, host_pre: None  # type: ignore[method-assign]
    if commit is not None:
        _commit_at_forged_step(proof, commit)
    model = MLP()
    state = TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), jnp.ones((4, 6)))["params"],
        # The learning rate lives in the optimizer state, where a forger can change it.
        tx=optax.inject_hyperparams(optax.adamw)(learning_rate=LEARNING_RATE),
    )
    step = proof.jit(_step, donate_argnums=(0,))
    rng = np.random.default_rng(1)
    for index in range(STEPS):
        if index == FORGED_STEP and between is not None:
            state = between(proof, state)
        state = step(state, jnp.asarray(rng.standard_normal((4, 7)), jnp.float32))
    proof.close()
    return path


def _bump(proof: zkdv.jax.ZKDV, state: Any) -> Any:
    return state.replace(params=jax.tree.map(lambda x: x + 1e-3, state.params))


def _invisible(proof: zkdv.jax.ZKDV, state: Any) -> Any:
    """Change the first kernel only along directions its probe cannot see."""
    proof.join()  # the transcript (and its probe set) is open once step 0 is committed
    probes = proof._core.probes  # type: ignore[union-attr]
    leaf = next(i for i, spec in enumerate(probes.specs) if spec.shape == (6, 16))
    matrix = probes.matrices[leaf].astype(np.float64)  # (16, kept)
    assert probes.rows[leaf] is None or len(probes.rows[leaf]) == 6
    null = np.linalg.svd(matrix.T)[2][matrix.shape[1] :]  # rows orthogonal to the probe
    change = np.random.default_rng(7).standard_normal((6, len(null))) @ null * 0.05
    params = jax.tree.map(lambda x: x, state.params)
    layer = next(name for name, dense in params.items() if dense["kernel"].shape == (6, 16))
    kernel = params[layer]["kernel"]
    params[layer]["kernel"] = kernel + jnp.asarray(change, kernel.dtype)
    return state.replace(params=params)


def _commit_at_forged_step(proof: zkdv.jax.ZKDV, commit: Callable[[str, Any], Any]) -> None:
    """A forger's SDK: ``commit(kind, host values)`` changes what FORGED_STEP commits (its
    ``batch`` or its ``gradient``, as read back from the device) after the step ran."""
    fetch = proof.transfers.fetch

    def forged(step: int, kind: str, value: Any) -> Any:
        host = fetch(step, kind, value)
        return commit(kind, host) if step == FORGED_STEP else host

    proof.transfers.fetch = forged  # type: ignore[method-assign]


def _scaled_gradient(kind: str, host: Any) -> Any:
    """Commit 1.01 times the gradient the optimizer applied."""
    if kind != "gradient":
        return host
    return [np.asarray(leaf) * np.float32(1.01) for leaf in host]


def _swapped_batch(kind: str, host: Any) -> Any:
    """Commit another batch than the one the step trained on (every value moved)."""
    return np.roll(np.asarray(host), 1, axis=1) if kind == "batch" else host


def _double_lr(proof: zkdv.jax.ZKDV, state: Any) -> Any:
    hyper = dict(state.opt_state.hyperparams)
    hyper["learning_rate"] = jnp.asarray(2 * LEARNING_RATE, hyper["learning_rate"].dtype)
    return state.replace(opt_state=state.opt_state._replace(hyperparams=hyper))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("jax-runs")
    return {
        "honest": _train(base / "honest"),
        "visible": _train(base / "visible", between=_bump, bypass=True),
        "invisible": _train(base / "invisible", between=_invisible, bypass=True),
        "lr": _train(base / "lr", between=_double_lr, bypass=True),
        "scaled": _train(base / "scaled", commit=_scaled_gradient),
        "swapped": _train(base / "swapped", commit=_swapped_batch),
        "no-files": _train(base / "no-files", gradient_files="never"),
        "scaled-no-files": _train(
            base / "scaled-no-files", commit=_scaled_gradient, gradient_files="never"
        ),
    }


@pytest.fixture
def honest_copy(runs: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs["honest"], tmp_path / "copy"))


def test_honest_run_replays_every_window_bit_for_bit(runs: dict[str, Path]) -> None:
    path = runs["honest"]
    transcript = Transcript.load(path)
    assert transcript.root["prover"] == "whitebox-jax"
    assert windows(transcript) == [(0, 2), (3, 5), (6, 7)]
    assert jax_replay.exact_environment(transcript.root)
    transition = jax_replay.load_transition(path)
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert [e.step for e in verdict.evidence] == list(range(first, last + 1))
        # The same artifact on the same backend reproduces the committed roots exactly.
        assert all(e.exact and e.batch_ok for e in verdict.evidence)


def test_every_step_record_counts_what_the_program_trains(runs: dict[str, Path]) -> None:
    transcript = Transcript.load(runs["honest"])
    transition = jax_replay.load_transition(runs["honest"])
    # The default unit counts examples: 4 rows of the (4, 7) batch per step.
    assert transition.tokens == 4
    assert {record["tokens"] for record in transcript.steps.values()} == {4}


def test_an_underreported_token_count_fails_every_replay(tmp_path: Path) -> None:
    # A modified SDK commits half of each step's count: the chain, the probes and the
    # replayed states are all honest, and the offline verifier has no program to count.
    with forgery.scaled_tokens(0.5):
        path = _train(tmp_path / "half")
    assert verify_transcript(path).ok
    for step in (0, 7):
        verdict = provers.verify_challenge(path, step)
        assert (verdict.ok, verdict.reason) == (False, "tokens_mismatch")
        assert "step 0: the record claims 2 tokens" in str(verdict.message)
        assert "trains 4 per step" in str(verdict.message)


def test_a_prover_loads_its_program_once_for_every_challenge(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[Path] = []
    original = jax_replay.load_transition

    def counted(path: Path) -> Any:
        loads.append(Path(path))
        return original(path)

    monkeypatch.setattr(jax_replay, "load_transition", counted)
    prover = provers.open_prover(runs["honest"], key="the honest run")
    assert prover.root["prover"] == "whitebox-jax"
    assert provers.open_prover(runs["honest"], key="the honest run") is prover
    assert prover.verify(2).ok and prover.verify(5, through=5).ok
    assert loads == [runs["honest"]]
    # A directory without a transcript has no prover to open.
    with pytest.raises(ReplayError) as raised:
        provers.Prover.open(tmp_path)
    assert raised.value.reason in {"missing_file", "invalid_transcript"}


def test_package_dispatches_on_the_prover(runs: dict[str, Path]) -> None:
    verdict = provers.verify_challenge(runs["honest"], 5)
    assert verdict.ok and (verdict.start, verdict.step) == (3, 5)
    assert verdict.to_dict()["evidence"][-1] == {
        "step": 5,
        "batch_ok": True,
        "exact": True,
        "probe_excess": verdict.evidence[-1].probe_excess,
        "ok": True,
        "gradient": verdict.evidence[-1].gradient,
        "state": "exact",
    }


def test_batch_file_that_differs_from_the_committed_batch(honest_copy: Path) -> None:
    file = batch_path(honest_copy, 4)
    data = bytearray(file.read_bytes())
    data[20] ^= 1
    file.write_bytes(bytes(data))
    verdict = jax_replay.verify_challenge(honest_copy, 5)
    assert (verdict.ok, verdict.reason) == (False, "batch_mismatch")
    assert "batch-00000004.u32 does not hash to step 4" in str(verdict.message)
    assert [e.ok for e in verdict.evidence] == [True, False]
    # Windows that do not need the file still pass.
    assert jax_replay.verify_challenge(honest_copy, 6, through=7).ok


def test_snapshot_that_does_not_hash_to_its_commitment(honest_copy: Path) -> None:
    file = snapshot_path(honest_copy, 3, "opt_state")
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x40
    file.write_bytes(bytes(data))
    verdict = jax_replay.verify_challenge(honest_copy, 4)
    assert (verdict.ok, verdict.reason, verdict.snapshot_ok) == (False, "snapshot_mismatch", False)
    assert "snapshot-00000003.opt_state.bin" in str(verdict.message)


def test_program_artifact_that_differs(honest_copy: Path) -> None:
    file = honest_copy / "program.jaxexport"
    # A well-formed artifact that is not the committed one.
    envelope = cbor2.loads(file.read_bytes())
    envelope["source"] = "elsewhere"
    file.write_bytes(cbor2.dumps(envelope, canonical=True))
    with pytest.raises(Exception, match="does not hash to the program digest") as raised:
        jax_replay.load_transition(honest_copy)
    assert getattr(raised.value, "reason", None) == "program_mismatch"
    verdict = provers.verify_challenge(honest_copy, 0)
    assert (verdict.ok, verdict.reason) == (False, "program_mismatch")
    file.unlink()
    assert provers.verify_challenge(honest_copy, 0).reason == "missing_file"


def test_frontend_rejects_a_state_modified_between_steps(tmp_path: Path) -> None:
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        _train(tmp_path / "bump", between=_bump)
    assert "parameters passed to step 4 are not the state committed after step 3" in str(
        raised.value.__cause__
    )
    # A learning rate held in the optimizer state is continuity-checked state too.
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        _train(tmp_path / "lr", between=_double_lr)
    assert "optimizer state passed to step 4" in str(raised.value.__cause__)


def test_visible_parameter_change_is_caught_by_the_offline_probe_check(
    runs: dict[str, Path],
) -> None:
    report = verify_transcript(runs["visible"])
    assert not report.ok and "step 4" in report.summary()
    verdict = jax_replay.verify_challenge(runs["visible"], 4)
    assert (verdict.ok, verdict.reason) == (False, "invalid_transcript")


def test_parameter_change_the_probes_cannot_see_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["invisible"]
    assert verify_transcript(path).ok  # the forger kept every probe consistent
    transition = jax_replay.load_transition(path)
    verdict = jax_replay.verify_challenge(path, 3, through=5, transition=transition)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    # Steps before the edit, and windows from a later snapshot, still replay.
    assert jax_replay.verify_challenge(path, 3, transition=transition).ok
    assert jax_replay.verify_challenge(path, 6, through=7, transition=transition).ok


def test_learning_rate_changed_mid_run_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["lr"]
    assert verify_transcript(path).ok  # the optimizer state carries no probes
    verdict = jax_replay.verify_challenge(path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")
    # Away from the recorded environment too: the update is canonical, so the committed
    # gradient with the committed learning rate must give the committed state exactly.
    loose = jax_replay.verify_challenge(path, 4, exact=False)
    assert (loose.ok, loose.reason) == (False, "replay_mismatch")
    assert str(loose.message).startswith("step 4: the optimizer applied to the committed")


def test_a_committed_gradient_scaled_by_one_percent_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["scaled"]
    assert verify_transcript(path).ok  # its grad root, file and probes agree
    for exact in (None, False):  # here, and as a worker on other hardware judges it
        verdict = jax_replay.verify_challenge(path, 3, through=5, exact=exact)
        assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
        assert str(verdict.message).startswith("step 4: the recomputed values differ")
        assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
        assert verdict.evidence[-1].gradient["margin"] > 1
    assert jax_replay.verify_challenge(path, 6, through=7).ok


def test_a_batch_swapped_after_commitment_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["swapped"]
    assert verify_transcript(path).ok  # the batch file hashes to the committed root
    verdict = jax_replay.verify_challenge(path, 3, through=5, exact=False)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    # The gradient of the committed batch is not the one the step committed.
    assert str(verdict.message).startswith("step 4: the recomputed values differ")


def test_a_gradient_file_that_is_not_the_committed_one(honest_copy: Path) -> None:
    file = gradient_path(honest_copy, 4)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    verdict = jax_replay.verify_challenge(honest_copy, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "gradient_mismatch")


def test_a_run_that_keeps_no_gradient_files_is_replayed_bit_for_bit(
    runs: dict[str, Path],
) -> None:
    """``gradient_files="never"`` (a TPU's default): no gradient is read back or
    written, and the replay recomputes each step's gradient, whose root must be the
    committed one."""
    path = runs["no-files"]
    transcript = Transcript.load(path)
    assert transcript.root["config"]["gradient_files"] == "never"
    assert not transcript.keeps_gradient_files
    assert not list((path / "files").glob("grad-*"))
    assert Transcript.load(runs["honest"]).root["config"]["gradient_files"] == "always"
    assert verify_transcript(path).ok
    # The same steps commit the same gradients whether or not their files are kept.
    honest = Transcript.load(runs["honest"])
    assert [transcript.steps[k]["grad"] for k in range(STEPS)] == [
        honest.steps[k]["grad"] for k in range(STEPS)
    ]
    transition = jax_replay.load_transition(path)
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert all(e.exact and e.gradient["exact"] for e in verdict.evidence)


def test_without_gradient_files_a_forged_gradient_fails_and_other_hardware_cannot_judge(
    runs: dict[str, Path],
) -> None:
    path = runs["scaled-no-files"]
    assert verify_transcript(path).ok  # its probes agree with its committed gradient
    verdict = jax_replay.verify_challenge(path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "gradient_mismatch")
    assert str(verdict.message).startswith("step 4: the recomputed values do not hash")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    # A worker in another kernel environment cannot tell rounding from forgery here.
    elsewhere = jax_replay.verify_challenge(path, 3, through=5, exact=False)
    assert (elsewhere.ok, elsewhere.reason) == (False, "inexact_environment")
    assert "kept no gradient files" in str(elsewhere.message)
    assert jax_replay.verify_challenge(path, 6, through=7).ok


def test_dispatch_imports_only_the_framework_it_needs() -> None:
    code = (
        "import sys, provers, provers.replay, provers.challenges; "
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {
        "PYTHONPATH": f"{root}:{AGENT_PYTHONPATH}",
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def _scan_run(path: Path, *, forge: bool = False) -> Path:
    """Four calls of ``zkdv.jax.scan`` with two updates each: steps 0-7, snapshots 0, 3, 6.

    ``forge``: a forger's run, whose step 4 (the second update of a call) commits 1.01
    times the gradient the loop applied, and step 7 its own post-update parameters.
    """
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=3,
    )
    proof.start(rolling_window=2, probe_ratio=0.5)
    if forge:
        _commit_at_forged_step(proof, _scaled_gradient)
    model = MLP()
    state = TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), jnp.ones((4, 6)))["params"],
        tx=optax.adamw(LEARNING_RATE),
    )

    @proof.jit(donate_argnums=(0,))
    def steps(state: Any, batches: jax.Array) -> Any:
        return zkdv.jax.scan(lambda state, batch: (_step(state, batch), None), state, batches)[0]

    rng = np.random.default_rng(1)
    with forgery.own_update(7, lambda a: a + np.float32(1e-3)) if forge else nullcontext():
        for _ in range(STEPS // 2):
            state = steps(state, jnp.asarray(rng.standard_normal((2, 4, 7)), jnp.float32))
        proof.close()
    return path


def test_updates_inside_a_scan_replay_as_steps(tmp_path: Path) -> None:
    path = _scan_run(tmp_path / "scan")
    transcript = Transcript.load(path)
    assert sorted(transcript.steps) == list(range(STEPS))
    # Windows start where the interval says, inside calls of two updates too.
    assert windows(transcript) == [(0, 2), (3, 5), (6, 7)]
    # Each update commits its gradient, and the loop applies the canonical update.
    assert [g["path"] for g in transcript.root["schema"]["grad"]] == [
        f"params:params['Dense_{layer}']['{name}']"
        for layer in (0, 1)
        for name in ("bias", "kernel")
    ]
    assert transcript.root["env"]["update"]["canonical"] is True
    transition = jax_replay.load_transition(path)
    for first, last in windows(transcript):
        verdict = jax_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert all(e.exact and e.batch_ok and e.state == "exact" for e in verdict.evidence)
        assert all(
            e.gradient == {"exact": True, "margin": 0.0, "worst": None} for e in verdict.evidence
        )
    # Step 4 is the second update of a call: its own batch file is what it is held to.
    file = batch_path(path, 4)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    verdict = jax_replay.verify_challenge(path, 3, through=5, transition=transition)
    assert (verdict.ok, verdict.reason) == (False, "batch_mismatch")
    assert "does not hash to step 4's committed batch root" in str(verdict.message)


def test_a_gradient_or_an_update_forged_inside_a_scan_fails_replay(tmp_path: Path) -> None:
    path = _scan_run(tmp_path / "forged", forge=True)
    assert verify_transcript(path).ok  # its roots, files and probes agree
    transition = jax_replay.load_transition(path)
    assert jax_replay.verify_challenge(path, 0, through=2, transition=transition).ok
    for exact in (None, False):  # here, and as a worker on other hardware judges it
        scaled = jax_replay.verify_challenge(path, 3, through=5, transition=transition, exact=exact)
        assert (scaled.ok, scaled.reason) == (False, "replay_mismatch")
        assert str(scaled.message).startswith("step 4: the recomputed values differ")
        assert [(e.step, e.ok) for e in scaled.evidence] == [(3, True), (4, False)]
        pushed = jax_replay.verify_challenge(path, 6, through=7, transition=transition, exact=exact)
        assert (pushed.ok, pushed.reason) == (False, "replay_mismatch")
        assert [(e.step, e.ok) for e in pushed.evidence] == [(6, True), (7, False)]
