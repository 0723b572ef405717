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

from provers.drift import REASON, RUN_THRESHOLD, WINDOW_P, Drift, combine, sign_flip_p

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
    for _ in range(200):
        drift = _window(rng, 12)
        assert not drift.exceeded, drift.describe()
        p_values.append(drift.p)
    # Under the null the p-value is (discretely) uniform: about a tenth at or below 0.1.
    assert 0.03 < np.mean(np.array(p_values) <= 0.1) < 0.2
    assert min(p_values) > WINDOW_P


def test_a_steered_push_at_a_small_share_of_the_bounds_fails() -> None:
    rng = np.random.default_rng(2)
    direction = rng.normal(size=SHAPE)
    # The norm test's bound of the reduced-precision row is 2.5e-2 |r|: push at 5 % of it,
    # 4.5 times the rounding's own size; a fresh share of it changes each step.
    bound = 2.5e-2 * float(np.linalg.norm(_gradient(rng)))
    push = (0.05 * bound * direction / np.linalg.norm(direction)).astype(np.float32)
    drift = _window(rng, 12, push=push)
    assert drift.exceeded
    assert drift.p <= 2.0**-10
    assert drift.cosine is not None and drift.cosine > 0.5
    message = drift.describe()
    assert "window from step 0" in message and "11 inexact steps" not in message
    assert "12 inexact steps (0 to 11)" in message and f"<= {WINDOW_P:g}" in message
    assert REASON == "gradient_drift"


def test_bit_exact_steps_have_no_statistic() -> None:
    drift = Drift(first=0)
    leaf = np.ones(SHAPE, np.float32)
    for step in range(12):
        drift.add(step, [("params:w", leaf)], [("params:w", leaf.copy())])
    assert drift.inexact == [] and drift.z is None and drift.p == 1.0 and not drift.exceeded


def test_a_run_combines_its_windows_once_each() -> None:
    rng = np.random.default_rng(3)
    honest = [_window(rng, 12).to_dict() for _ in range(8)]
    run = combine(honest)
    assert run["z"] is not None and not run["exceeded"]
    # A push in every window, each too short for the window test (4 steps: p >= 1/8),
    # adds up across the run's 30 windows (z up to sqrt(30 * 6) = 13.4).
    direction = rng.normal(size=SHAPE).astype(np.float32)
    push = 1e-2 * direction / np.linalg.norm(direction)
    short = []
    for first in range(0, 360, 12):
        drift = _window(rng, 4, push=push)
        drift.first, drift.last = first, first + 3
        assert not drift.exceeded
        short.append(drift.to_dict())
    forged = combine([*short, {**short[0], "last": 1, "alignment": 1e9}])
    assert forged["windows"] == list(range(0, 360, 12))  # the shorter replay is not counted
    assert forged["exceeded"] and forged["z"] > RUN_THRESHOLD
