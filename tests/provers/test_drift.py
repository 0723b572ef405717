"""The drift test (``provers.drift``): rounding-like differences pass, a steered push fails.

The differences are built as a replay sees them: committed minus recomputed values of
one leaf per step. Honest rounding is modelled by independent symmetric noise whose
coordinates are strongly correlated *within* a step (a rank-one outer product, as one
rounding in the backward pass moves a whole gradient matrix); the push is a fixed
direction at a small share of the noise-free gradient's bound.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from provers.drift import REASON, RUN_P, WINDOW_P, Drift, combine, run_p, sign_flip_p

SHAPE = (32, 16)


def _gradient(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(size=SHAPE).astype(np.float32)


def _rounding(rng: np.random.Generator, scale: float) -> np.ndarray:
    """Rank-one noise: every coordinate of a step moves together, the step's sign is random."""
    return (scale * np.outer(rng.normal(size=SHAPE[0]), rng.normal(size=SHAPE[1]))).astype(
        np.float32
    )


def _window(
    rng: np.random.Generator, steps: int, *, push: np.ndarray | None = None, noise: float = 1e-4
) -> Drift:
    drift = Drift(first=0)
    for step in range(steps):
        recomputed = _gradient(rng)
        committed = recomputed + _rounding(rng, noise)
        if push is not None:
            committed = committed + push
        drift.add(step, [("params:w", recomputed)], [("params:w", committed)])
    drift.last = steps - 1
    return drift


def test_the_p_value_is_exact_over_whole_step_sign_flips() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(5, 7))
    gram = vectors @ vectors.T
    observed = np.triu(gram, 1).sum()
    patterns = [np.array((1.0, *rest)) for rest in itertools.product((1.0, -1.0), repeat=4)]
    expected = np.mean([np.triu(np.outer(e, e) * gram, 1).sum() >= observed for e in patterns])
    assert sign_flip_p(gram) == pytest.approx(expected)
    # Aligned differences take the maximising pattern: the smallest p-value there is.
    aligned = np.ones((12, 12))
    assert sign_flip_p(aligned) == pytest.approx(2.0**-11)


def test_independent_rounding_correlated_within_each_step_passes() -> None:
    rng = np.random.default_rng(1)
    p_values = []
    windows = []
    for _ in range(200):
        drift = _window(rng, 12)
        assert not drift.exceeded
        p_values.append(sign_flip_p(np.asarray(drift.to_dict()["gram"])))
        windows.append(drift.to_dict())
    # Under the null the p-value is (discretely) uniform: about a tenth at or below 0.1.
    assert 0.03 < np.mean(np.array(p_values) <= 0.1) < 0.2
    # Runs of 8 windows: the Chernoff bound is conservative, never near RUN_P.
    runs = [combine(windows[i : i + 8]) for i in range(0, 200, 8)]
    assert min(run["p"] for run in runs) > 1e-3
    assert not any(run["exceeded"] for run in runs)


def _push(rng: np.random.Generator, share: float) -> np.ndarray:
    # The norm test's bound of the reduced-precision row is 2.5e-2 |r|: a push at
    # ``share`` of it, in one direction.
    direction = rng.normal(size=SHAPE)
    bound = 2.5e-2 * float(np.linalg.norm(_gradient(rng)))
    return (share * bound * direction / np.linalg.norm(direction)).astype(np.float32)


def test_a_steered_push_at_a_small_share_of_the_bounds_fails_a_long_window() -> None:
    # 5 % of the bound is 4.5 times the rounding's own size here. A window's whole-step
    # signs carry m - 1 bits: 12 aligned steps reach p = 2^-11, not WINDOW_P; 24 do.
    rng = np.random.default_rng(2)
    push = _push(rng, 0.05)
    short = _window(rng, 12, push=push)
    assert not short.exceeded and short.p == 1.0  # not computed: it cannot fail
    assert sign_flip_p(np.asarray(short.to_dict()["gram"])) == pytest.approx(2.0**-11)
    drift = _window(rng, 24, push=push)
    assert drift.exceeded and drift.p <= WINDOW_P
    assert drift.cosine is not None and drift.cosine > 0.5
    message = drift.describe()
    assert "window from step 0" in message and "24 inexact steps (0 to 23)" in message
    assert f"<= {WINDOW_P:g}" in message and "exact sign-flip p = " in message
    assert REASON == "gradient_drift"


def test_bit_exact_steps_have_no_statistic() -> None:
    drift = Drift(first=0)
    leaf = np.ones(SHAPE, np.float32)
    for step in range(12):
        drift.add(step, [("params:w", leaf)], [("params:w", leaf.copy())])
    assert drift.inexact == [] and drift.z is None and drift.p == 1.0 and not drift.exceeded


@pytest.mark.filterwarnings("error")
def test_non_finite_coordinates_are_left_out_quietly() -> None:
    # An attention mask's -inf on both sides, a NaN on both: no difference, no warning.
    rng = np.random.default_rng(3)
    drift = Drift(first=0)
    for step in range(3):
        recomputed = _gradient(rng)
        recomputed[0, :2] = (-np.inf, np.nan)
        committed = recomputed + _rounding(rng, 1e-4)
        drift.add(step, [("params:w", recomputed)], [("params:w", committed)])
    assert drift.inexact == [0, 1, 2]
    assert np.isfinite(drift.z) and 0.0 < drift.p <= 1.0


def test_a_run_combines_its_windows_once_each() -> None:
    rng = np.random.default_rng(3)
    push = _push(rng, 0.05)
    # Two windows of 12 aligned steps: p about 2^-22, below RUN_P.
    windows = []
    for first in (0, 12):
        drift = _window(rng, 12, push=push)
        drift.first, drift.last = first, first + 11
        windows.append(drift.to_dict())
    run = combine(windows)
    assert run["exceeded"] and run["p"] <= RUN_P and run["windows"] == [0, 12]
    assert run["z"] == pytest.approx(np.sqrt(2 * 66), rel=0.05)
    # A shorter replay of the same window (a challenge of an earlier step) counts once.
    shorter = {**windows[0], "last": 5, "gram": [row[:6] for row in windows[0]["gram"][:6]]}
    assert combine([*windows, shorter])["p"] == pytest.approx(run["p"])
    # One window alone cannot fail the run.
    assert not combine(windows[:1])["exceeded"]


def test_the_run_bound_is_a_chernoff_bound_of_the_exact_distribution() -> None:
    rng = np.random.default_rng(4)
    vectors = [rng.normal(size=(4, 5)) for _ in range(3)]
    grams = [v @ v.T for v in vectors]
    observed = sum(np.triu(g, 1).sum() for g in grams)
    patterns = [np.array((1.0, *rest)) for rest in itertools.product((1.0, -1.0), repeat=3)]
    totals = [0.0]
    for g in grams:
        values = [np.triu(np.outer(e, e) * g, 1).sum() for e in patterns]
        totals = [t + v for t in totals for v in values]
    exact = np.mean(np.array(totals) >= observed - 1e-9)
    assert exact <= run_p(grams) <= 1.0


def test_a_large_gradients_differences_are_kept_in_a_file_with_the_same_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 135M-parameter model's window would otherwise hold 12 gradients in memory.
    from provers import drift

    push = np.full(SHAPE, 1e-3, np.float32)
    in_memory = _window(np.random.default_rng(5), 12, push=push)
    monkeypatch.setattr(drift, "IN_MEMORY_BYTES", 0)
    in_files = _window(np.random.default_rng(5), 12, push=push)
    assert all(isinstance(d, np.memmap) for d in in_files._differences)
    assert not any(isinstance(d, np.memmap) for d in in_memory._differences)
    np.testing.assert_array_equal(in_files._gram, in_memory._gram)
    assert in_files.history == in_memory.history
