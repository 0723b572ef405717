"""The framework-neutral replay: honest runs pass, forgeries fail with a precise reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from provers.replay import Transcript, Transition, replay, windows
from tests.synthetic import LinearSGD, write_synthetic_transcript
from zkdv.files import batch_path, gradient_path, snapshot_path

FEATURES = 6


def transition(params, opt_state, buffers, batch, step=None):  # type: ignore[no-untyped-def]
    """The attested program of the synthetic runs, as a state transition."""
    model = LinearSGD(FEATURES)
    p, s = dict(params), dict(opt_state)
    deltas, new_p, new_s = model.update(p, s, batch)
    leaves = lambda tree: [(k, tree[k]) for k in sorted(tree)]  # noqa: E731
    return leaves(new_p), leaves(new_s), list(buffers), leaves(deltas)


def _run(tmp_path: Path, forge: str | None = None) -> Path:
    return write_synthetic_transcript(
        tmp_path / (forge or "honest"), steps=8, features=FEATURES, forge=forge, forge_step=3
    )


def test_honest_run_replays_exactly_on_every_window(tmp_path: Path) -> None:
    path = _run(tmp_path)
    transcript = Transcript.load(path)
    assert windows(transcript) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for first, last in windows(transcript):
        verdict = replay(transcript, step=first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert [e.step for e in verdict.evidence] == list(range(first, last + 1))
        assert all(e.exact and e.batch_ok for e in verdict.evidence)


@pytest.mark.parametrize(
    ("forge", "step"),
    [("outside_step", 4), ("batches", 3), ("lr", 3)],
)
def test_forgeries_that_pass_the_offline_verifier_fail_replay(
    tmp_path: Path, forge: str, step: int
) -> None:
    path = _run(tmp_path, forge)
    verdict = replay(path, step=step, transition=transition)
    assert not verdict.ok
    assert verdict.reason == "replay_mismatch"
    assert f"step {step}" in verdict.message
    # Steps before the forgery still replay.
    assert replay(path, step=1, transition=transition).ok


def test_snapshot_that_does_not_hash_to_its_commitment(tmp_path: Path) -> None:
    path = _run(tmp_path)
    file = snapshot_path(path, 4, "params")
    data = bytearray(file.read_bytes())
    data[0] ^= 1
    file.write_bytes(bytes(data))
    verdict = replay(path, step=5, transition=transition)
    assert (verdict.ok, verdict.reason, verdict.snapshot_ok) == (False, "snapshot_mismatch", False)
    assert "snapshot-00000004.params.bin does not hash" in verdict.message


def test_batch_file_that_does_not_hash_to_its_commitment(tmp_path: Path) -> None:
    path = _run(tmp_path)
    file = batch_path(path, 5)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    verdict = replay(path, step=5, transition=transition)
    assert (verdict.reason, verdict.evidence[-1].batch_ok) == ("batch_mismatch", False)


def test_missing_files_are_named(tmp_path: Path) -> None:
    path = _run(tmp_path)
    batch_path(path, 2).unlink()
    verdict = replay(path, step=3, transition=transition)
    assert verdict.reason == "missing_file" and "batch-00000002.u32" in verdict.message


def test_replay_within_tolerance_when_not_bitwise(tmp_path: Path) -> None:
    # A transition that rounds differently (as compiled code does) is judged by probes.
    path = _run(tmp_path)

    def noisy(params, opt_state, buffers, batch, step):  # type: ignore[no-untyped-def]
        p, s, b, d = transition(params, opt_state, buffers, batch, step)
        nudge = lambda leaves: [(k, (v * np.float32(1 + 1e-6)).astype(v.dtype)) for k, v in leaves]  # noqa: E731
        return nudge(p), s, b, d

    verdict = replay(path, step=3, transition=noisy)
    assert verdict.ok, verdict.message
    assert not any(e.exact for e in verdict.evidence)
    assert all(e.probe_excess is not None and e.probe_excess <= 0 for e in verdict.evidence)


# --- runs that commit their gradients -------------------------------------------------------
# The replay recomputes each step's gradient (the gradient program), compares it with the
# committed one within the run's GradientBounds, then applies the optimizer to the committed
# gradient and demands the committed roots bit for bit.


def _leaves(tree):  # type: ignore[no-untyped-def]
    return [(k, tree[k]) for k in sorted(tree)]


def _halves(noise: float = 0.0, seed: int = 0) -> Transition:
    """LinearSGD's step as the two halves; ``noise`` perturbs the recomputed gradient by
    that relative amount in a random direction, as another machine's rounding does."""
    model = LinearSGD(FEATURES)
    rng = np.random.default_rng(seed)

    def compute(params, opt_state, buffers, batch, step):  # type: ignore[no-untyped-def]
        grads = model.gradients(dict(params), batch)
        out = []
        for name, value in _leaves(grads):
            if noise:
                jitter = rng.standard_normal(value.shape).astype(np.float32)
                jitter *= np.float32(noise * np.linalg.norm(value) / np.linalg.norm(jitter))
                value = (value + jitter).astype(np.float32)
            out.append((f"params:{name}", value))
        return out

    def apply(params, opt_state, buffers, committed, step):  # type: ignore[no-untyped-def]
        grads = {name.removeprefix("params:"): value for name, value in committed}
        deltas, new_p, new_s = model.apply(dict(params), dict(opt_state), grads)
        return _leaves(new_p), _leaves(new_s), list(buffers), _leaves(deltas)

    return Transition(transition, compute, apply, canonical=True)


def _gradient_run(tmp_path: Path, forge: str | None = None) -> Path:
    return write_synthetic_transcript(
        tmp_path / (forge or "honest"),
        steps=8,
        features=FEATURES,
        forge=forge,
        forge_step=3,
        gradients=True,
    )


def test_a_run_with_committed_gradients_replays_every_step_exactly(tmp_path: Path) -> None:
    path = _gradient_run(tmp_path)
    transcript = Transcript.load(path)
    assert [spec.path for spec in transcript.grad or ()] == ["params:b", "params:w"]
    for first, last in windows(transcript):
        verdict = replay(transcript, step=first, through=last, transition=_halves())
        assert verdict.ok, verdict.message
        assert all(e.exact and e.gradient == {"exact": True, "margin": 0.0, "worst": None}
                   for e in verdict.evidence)  # fmt: skip
        assert verdict.bounds == {"tensor": 1e-4, "total": 2e-5, "scale": 1e-5}


def test_another_machines_rounding_passes_within_the_bounds(tmp_path: Path) -> None:
    # A recomputed gradient off by 1e-6 of its norm in a random direction, as an honest
    # replay on other kernels is: within bounds, and the state still reproduced exactly.
    path = _gradient_run(tmp_path)
    verdict = replay(path, step=2, through=3, transition=_halves(noise=1e-6))
    assert verdict.ok, verdict.message
    for evidence in verdict.evidence:
        assert not evidence.exact and evidence.gradient is not None
        assert 0 < evidence.gradient["margin"] < 0.2


def test_a_gradient_far_off_fails_the_bounds(tmp_path: Path) -> None:
    # 1e-3 of the norm is ten times the tensor bound (and, on a leaf of one element,
    # all of it lies along the gradient).
    path = _gradient_run(tmp_path)
    verdict = replay(path, step=2, transition=_halves(noise=1e-3))
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert "beyond the run's gradient bounds" in str(verdict.message)
    assert verdict.evidence[-1].gradient["margin"] > 5  # type: ignore[index]


@pytest.mark.parametrize(
    ("forge", "test"),
    [
        ("scaled_gradient", "scale"),  # trained on, and committed, the gradient times 1.01
        ("batches", "norm"),  # trained on other batches than committed
    ],
)
def test_a_committed_gradient_that_is_not_the_recomputed_one_is_caught(
    tmp_path: Path, forge: str, test: str
) -> None:
    path = _gradient_run(tmp_path, forge)
    assert replay(path, step=2, transition=_halves()).ok  # before the forgery
    verdict = replay(path, step=3, transition=_halves())
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 3: the recomputed values differ")
    worst = verdict.evidence[-1].gradient["worst"]  # type: ignore[index]
    assert worst["test"] == test or forge == "batches"


def test_a_state_the_committed_gradient_does_not_give_is_caught(tmp_path: Path) -> None:
    # The gradient is honest; the update (another learning rate) is not: the canonical
    # optimizer on the committed gradient misses the committed roots.
    path = _gradient_run(tmp_path, "lr")
    verdict = replay(path, step=3, transition=_halves())
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert "does not give the committed post-update state" in str(verdict.message)


def test_parameters_changed_between_steps_are_caught(tmp_path: Path) -> None:
    # Step 4 trained from other parameters than step 3 committed: its gradient is not
    # the one the committed state gives.
    path = _gradient_run(tmp_path, "outside_step")
    verdict = replay(path, step=4, transition=_halves())
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")


def test_a_gradient_file_is_checked_against_its_root(tmp_path: Path) -> None:
    path = _gradient_run(tmp_path)
    file = gradient_path(path, 3)
    data = bytearray(file.read_bytes())
    data[0] ^= 1
    file.write_bytes(bytes(data))
    verdict = replay(path, step=3, transition=_halves())
    assert verdict.reason == "gradient_mismatch"
    assert "grad-00000003.bin does not hash to step 3's committed grad root" in verdict.message
    file.unlink()
    verdict = replay(path, step=3, transition=_halves())
    assert verdict.reason == "missing_file" and "grad-00000003.bin" in verdict.message


def test_a_prover_that_cannot_split_the_step_says_so(tmp_path: Path) -> None:
    verdict = replay(_gradient_run(tmp_path), step=1, transition=transition)
    assert (verdict.ok, verdict.reason) == (False, "unsupported_program")
