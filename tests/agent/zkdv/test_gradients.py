"""zkdv.gradients.compare: how a recomputed gradient is judged against the committed one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zkdv.config import GradientBounds
from zkdv.gradients import WHOLE, compare, leaf_name, split_name

BOUNDS = GradientBounds(tensor=1e-4, total=2e-5, scale=1e-5)
RNG = np.random.default_rng(0)


def _gradient() -> list[tuple[str, np.ndarray]]:
    return [
        ("params:weight", RNG.standard_normal((64, 32)).astype(np.float32)),
        ("params:bias", RNG.standard_normal(32).astype(np.float32)),
        # A bias in front of BatchNorm: its true gradient is zero, its value rounding noise.
        ("params:noise", (RNG.standard_normal(32) * 1e-9).astype(np.float32)),
    ]


def _noisy(leaves: list[tuple[str, np.ndarray]], relative: float) -> list[tuple[str, np.ndarray]]:
    """Each leaf off by ``relative`` of the whole gradient's norm in a random direction,
    as another machine's rounding is."""
    total = math.sqrt(sum(float(np.linalg.norm(a)) ** 2 for _, a in leaves))
    out = []
    for name, array in leaves:
        jitter = RNG.standard_normal(array.shape)
        jitter *= relative * total / math.sqrt(len(leaves)) / np.linalg.norm(jitter)
        out.append((name, (array + jitter).astype(np.float32)))
    return out


def test_bitwise_equal_is_exact_with_no_margin() -> None:
    gradient = _gradient()
    comparison = compare(gradient, [(n, a.copy()) for n, a in gradient], BOUNDS)
    assert comparison.ok and comparison.exact and comparison.margin == 0.0
    assert comparison.describe() == "bitwise equal"
    assert {leaf.test for leaf in comparison.leaves} == {"norm", "scale"}
    assert comparison.leaves[-1].path == WHOLE


def test_rounding_noise_passes_and_the_noise_leaf_is_covered_by_the_total_term() -> None:
    gradient = _gradient()
    noisy = _noisy(gradient, 1e-7)  # the noise leaf is now 100x off its own norm
    comparison = compare(gradient, noisy, BOUNDS)
    assert comparison.ok and not comparison.exact
    assert 0 < comparison.margin < 0.2


def test_a_scaled_gradient_fails_the_scale_test_where_the_norm_test_passes() -> None:
    gradient = _gradient()
    bounds = GradientBounds.default("reduced")  # tensor 2.5e-2: a 1 % scaling passes it
    scaled = [(n, (a * np.float32(1.01)).astype(np.float32)) for n, a in gradient]
    comparison = compare(gradient, scaled, bounds)
    assert not comparison.ok
    failing = {(leaf.path, leaf.test) for leaf in comparison.leaves if leaf.ratio > 1}
    assert ("params:weight", "scale") in failing and (WHOLE, "scale") in failing
    assert not any(test == "norm" for _, test in failing)
    assert "along its own direction" in comparison.describe()


def test_bounds_are_relative_to_the_replayed_values_not_the_committed_ones() -> None:
    # A committed gradient ten times larger cannot widen the bound it is judged by.
    gradient = _gradient()
    inflated = [(n, (a * np.float32(10)).astype(np.float32)) for n, a in gradient]
    comparison = compare(gradient, inflated, BOUNDS)
    assert not comparison.ok
    norm = next(leaf for leaf in comparison.leaves if leaf.path == "params:weight")
    assert norm.norm == pytest.approx(float(np.linalg.norm(gradient[0][1])), rel=1e-6)


def test_non_finite_values_must_be_the_same_overflow() -> None:
    replayed = [("params:w", np.array([1.0, np.inf, np.nan], np.float32))]
    same = [("params:w", np.array([1.0, np.inf, np.nan], np.float32))]
    assert compare(replayed, same, BOUNDS).ok
    other = [("params:w", np.array([1.0, -np.inf, np.nan], np.float32))]
    assert math.isinf(compare(replayed, other, BOUNDS).margin)
    finite = [("params:w", np.array([1.0, 2.0, 3.0], np.float32))]
    assert not compare(replayed, finite, BOUNDS).ok


def test_integer_leaves_must_be_equal() -> None:
    counter = [("buffers:count", np.array(3, np.int64))]
    assert compare(counter, [("buffers:count", np.array(3, np.int64))], BOUNDS).ok
    assert not compare(counter, [("buffers:count", np.array(4, np.int64))], BOUNDS).ok


def test_carried_leaves_are_bounded_by_their_own_group() -> None:
    stats = np.full(16, 2.0, np.float32)
    gradient = [("params:w", np.full(16, 1e-3, np.float32)), ("buffers:running_var", stats)]
    drift = [
        gradient[0],
        ("buffers:running_var", (stats * np.float32(1 + 1e-6)).astype(np.float32)),
    ]
    assert compare(gradient, drift, BOUNDS).ok  # not judged against the tiny gradient


def test_leaves_must_match() -> None:
    with pytest.raises(ValueError, match="different leaves"):
        compare(_gradient(), _gradient()[:2], BOUNDS)


def test_names() -> None:
    assert split_name(leaf_name("buffers", "1.running_mean")) == ("buffers", "1.running_mean")
    with pytest.raises(ValueError, match="must be named"):
        split_name("grads:w")


def test_default_bounds_by_precision() -> None:
    assert GradientBounds.default("float32") == BOUNDS
    assert GradientBounds.default("reduced").tensor > GradientBounds.default("float32").tensor
    assert GradientBounds.default("reduced", compiled=True).scale >= 0.05
    with pytest.raises(ValueError, match="precision"):
        GradientBounds.default("tf32")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        GradientBounds(tensor=1.0, total=0.0, scale=0.0)
