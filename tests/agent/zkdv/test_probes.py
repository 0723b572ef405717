"""Probes are seeded, orthonormal, linear, and exact in any summation order."""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkdv import _probe_pass as probes_module
from zkdv.merkle import LeafSpec
from zkdv.probes import (
    MAX_PROBE_ROWS,
    ProbeSet,
    exact_finish,
    exact_matrix,
    exact_rows,
    slice_width,
)

HAS_NUMBA = importlib.util.find_spec("numba") is not None
PATHS = [
    pytest.param("compiled", marks=pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")),
    "numpy",
]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test that takes it runs on the compiled pass (Numba) and on the numpy path."""
    monkeypatch.setenv(probes_module.JIT_ENV, "1" if request.param == "compiled" else "0")
    monkeypatch.setattr(probes_module, "SMALL_PROJECTION_VALUES", 0)  # the pass at any size
    yield request.param
    if request.param == "compiled":
        assert probes_module._kernel() is not None  # it did not fall back to numpy


def test_probe_matrices_are_orthonormal_and_seeded() -> None:
    specs = [
        LeafSpec("w", "float32", (300, 257)),
        LeafSpec("b", "float32", (7,)),
        LeafSpec("s", "float32", ()),
    ]
    probes = ProbeSet.create(specs, 0.01, b"seed" * 4)
    assert [m.shape for m in probes.matrices] == [(257, 3), (7, 1), (1, 1)]
    q = probes.matrices[0].astype(np.float64)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-6)
    again = ProbeSet.create(specs, 0.01, b"seed" * 4)
    assert all(np.array_equal(a, b) for a, b in zip(probes.matrices, again.matrices, strict=True))
    other = ProbeSet.create(specs, 0.01, b"SEED" * 4)
    assert not np.array_equal(probes.matrices[0], other.matrices[0])


def test_probes_are_linear_and_bounded_in_rows() -> None:
    rng = np.random.default_rng(0)
    spec = LeafSpec("w", "float32", (300, 64))
    probes = ProbeSet.create([spec], 0.1, bytes(16))
    pre = rng.standard_normal((300, 64)).astype(np.float32)
    delta = rng.standard_normal((300, 64)).astype(np.float32) * 1e-3
    post = pre + delta
    p_pre, p_post, p_delta = (probes.project(0, a) for a in (pre, post, delta))
    assert p_pre.shape == (MAX_PROBE_ROWS, 7)
    np.testing.assert_allclose(p_post, p_pre + p_delta, rtol=1e-4, atol=1e-5)
    assert probes.floats == MAX_PROBE_ROWS * 7


def _wide_rows(rng: np.random.Generator, rows: int, d: int) -> np.ndarray:
    """Rows whose elements span many binades, with zeros, subnormals and huge values."""
    values = rng.standard_normal((rows, d)) * np.exp2(rng.integers(-40, 40, (rows, d)))
    values = values.astype(np.float32)
    values[0, : d // 3] = 0.0
    if rows > 1:
        values[1] = np.float32(1e-40) * rng.standard_normal(d).astype(np.float32)
    if rows > 2:
        values[2, 0] = np.float32(3e38)
    return values


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_probe_sums_are_exact_in_any_order(d: int, k: int, seed: int) -> None:
    # The reason device and host probes agree to the bit: every float64 GEMM of the
    # slices is exact, so permuting the summation order (here: the order of the d
    # terms) cannot change a bit of the probe.
    rng = np.random.default_rng(seed)
    values = _wide_rows(rng, 4, d)
    matrix = exact_matrix(rng.standard_normal((d, k)).astype(np.float32) / np.sqrt(d))
    split, scale, bad = exact_rows(values)
    products = split @ matrix.astype(np.float64)
    order = rng.permutation(d)
    permuted = split[:, order] @ matrix[order].astype(np.float64)
    assert np.array_equal(products, permuted)
    blocked = sum(
        split[:, i : i + 7] @ matrix[i : i + 7].astype(np.float64) for i in range(0, d, 7)
    )
    assert np.array_equal(products, blocked)
    width = slice_width(d)
    first = exact_finish(products, scale, width, bad)
    again = exact_finish(permuted, scale, width, bad)
    assert np.array_equal(first.view(np.uint32), again.view(np.uint32))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 400), st.integers(0, 2**32 - 1))
def test_probe_slices_are_integers_whose_products_fit_float64(d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = _wide_rows(rng, 3, d)
    split, _, _ = exact_rows(values)
    width = slice_width(d)
    assert np.array_equal(split, np.trunc(split))
    assert np.abs(split).max(initial=0) < 2.0**width
    matrix = exact_matrix(rng.standard_normal((d, 2)).astype(np.float32))
    _, top = np.frexp(np.abs(matrix).max(axis=0))
    units = matrix.astype(np.float64) * np.ldexp(1.0, width - top)
    assert np.array_equal(units, np.trunc(units))
    # Exact integer arithmetic agrees with the float64 GEMM.
    exact = [
        [sum(int(a) * int(b) for a, b in zip(row, col, strict=True)) for col in units.T]
        for row in split
    ]
    assert np.array_equal(split @ units, np.array(exact, dtype=np.float64))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(0, 2**32 - 1), st.booleans())
def test_slices_are_the_rows_truncated_below_their_peak(d: int, seed: int, tiny: bool) -> None:
    """The slices, against exact rational arithmetic: n1 + n2 / 2**w is each element in
    units of 2**(e - w), truncated toward zero, e the exponent of its row's peak."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((4, d)) * np.exp2(rng.integers(-60, 60, (4, 1)))).astype(
        np.float32
    )
    values[1, : d // 2] = 0.0
    values[2] = 0.0
    if tiny:  # a nonzero row below 2**(2w - 127): subnormals are flushed
        values[3] = (rng.standard_normal(d) * 1e-39).astype(np.float32)
    split, scale, _ = exact_rows(values)
    width = slice_width(d)
    rows = len(values)
    for r in range(rows):
        flush = tiny and r == 3
        for j in range(d):
            v = float(values[r, j])
            if flush and abs(v) < 2.0**-126:
                v = 0.0
            units = Fraction(v) * Fraction(scale[r]) * 2**width  # exact
            whole = math.trunc(units)
            got = Fraction(split[r, j]) * 2**width + Fraction(split[rows + r, j])
            assert got == whole, (r, j, v)
            assert abs(split[r, j]) < 2.0**width and abs(split[rows + r, j]) < 2.0**width


def test_probes_are_close_to_float64_projection() -> None:
    rng = np.random.default_rng(3)
    spec = LeafSpec("w", "float32", (100, 512))
    probes = ProbeSet.create([spec], 0.02, bytes(16))
    values = rng.standard_normal((100, 512)).astype(np.float32)
    got = probes.project(0, values)
    want = values[probes.rows[0]].astype(np.float64) @ probes.matrices[0].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2**-23, atol=1e-30)


def test_special_values_are_canonical(path: str) -> None:
    spec = LeafSpec("w", "float32", (4, 3))
    probes = ProbeSet.create([spec], 1.0, bytes(16))
    values = np.array(
        [[np.inf, 1, 2], [np.nan, 0, 0], [-0.0, -0.0, -0.0], [1e-40, -1e-41, 0]], np.float32
    )
    bits = probes.project(0, values).view(np.uint32)
    assert (bits[:2] == 0x7FC00000).all()
    assert (bits[2:] == 0).all()


@settings(max_examples=30, deadline=None)
@given(d=st.sampled_from([1, 7, 64, 513]), seed=st.integers(0, 2**32 - 1))
def test_rows_projected_together_have_the_bits_of_one_call_each(d: int, seed: int) -> None:
    # (hypothesis and a function-scoped fixture do not mix: the paths are swept inside.)
    for setting in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(probes_module.JIT_ENV, setting)
            patch.setattr(probes_module, "SMALL_PROJECTION_VALUES", 0)
            _rows_projected_together(d, seed)


def _rows_projected_together(d: int, seed: int) -> None:
    """Arrays of several leaves (some of the same width, some not) in one call."""
    rng = np.random.default_rng(seed)
    shapes = [(40, d), (3, 5), (90, d), (d,)]
    probes = ProbeSet.create(
        [LeafSpec(f"w{i}", "float32", s) for i, s in enumerate(shapes)], 0.05, bytes(16)
    )
    jobs = []
    for leaf, shape in enumerate(shapes):
        width = shape[-1]
        arrays = [_wide_rows(rng, int(rng.integers(1, 40)), width) for _ in range(leaf % 3 + 1)]
        arrays[0][0, 0] = np.nan  # a bad row among good ones
        jobs.append((leaf, arrays))
    together = probes.project_many(jobs)
    for (leaf, arrays), results in zip(jobs, together, strict=True):
        assert len(results) == len(arrays)
        for array, got in zip(arrays, results, strict=True):
            alone = probes.project_rows(leaf, array).view(np.uint32).tobytes()
            assert got.view(np.uint32).tobytes() == alone


def _step(probes: ProbeSet, before: np.ndarray, after: np.ndarray) -> list[np.ndarray]:
    pre, post, delta = probes.project_steps([before], [after])
    return [pre[0], post[0], delta[0]]


def test_a_step_reuses_the_previous_post_probe_only_for_the_same_bits(path: str) -> None:
    rng = np.random.default_rng(7)
    # Eleven rows: the compiled pass takes rows two at a time, so the last is alone.
    probes = ProbeSet.create([LeafSpec("w", "float32", (11, 33))], 0.1, bytes(16))

    def fresh(rows: np.ndarray) -> bytes:
        return probes.project_rows(0, rows).view(np.uint32).tobytes()

    live = rng.standard_normal((11, 33)).astype(np.float32)
    before = live.copy()
    live += np.float32(1e-3)  # the update, in place
    pre, post, delta = _step(probes, before, live[:])  # ``after`` a view of live
    assert [p.view(np.uint32).tobytes() for p in (pre, post, delta)] == [
        fresh(before),
        fresh(live),
        fresh(live - before),
    ]
    # The next step starts from those bits: its pre-update probe is that post probe, even
    # though the update overwrote the array the rows were viewed in.
    start = live.copy()
    live *= np.float32(0.5)
    again, _, delta2 = _step(probes, start, live[:])
    assert again is post
    assert delta2.view(np.uint32).tobytes() == fresh(live - start)
    # Rows changed between steps (one sign of zero is enough, in the first row or in the
    # last, alone in its pair): computed afresh.
    for row, column in ((0, 0), (10, 32)):
        previous = live.copy()
        live *= np.float32(0.5)
        _, last_post, _ = _step(probes, previous, live[:])
        start = live.copy()
        value = start[row, column]
        start[row, column] = np.float32(-0.0) if value == 0 else -value
        changed, _, delta3 = _step(probes, start, live.copy())
        assert changed is not last_post
        assert changed.view(np.uint32).tobytes() == fresh(start)
        assert delta3.view(np.uint32).tobytes() == fresh(live - start)


def _exact_probe(row: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """One row's probe from its definition, in exact rational arithmetic.

    Subnormals flushed; ``u = trunc(v * 2**(2w - e))`` per element (``2**e`` above the
    row's peak); the probe ``float32(float64(sum(u * q) / 2**(2w - e)))`` (the float64
    rounding of the exact sum, then float32), below float32's smallest normal +0, and
    the quiet NaN for a row holding an infinity or NaN.
    """
    d, k = matrix.shape
    values = [float(v) for v in row]
    if not all(math.isfinite(v) for v in values):
        return np.full(k, 0x7FC00000, dtype=np.uint32).view(np.float32)
    values = [0.0 if abs(v) < 2.0**-126 else v for v in values]
    _, top = math.frexp(max(abs(v) for v in values))
    shift = 2 * slice_width(d) - top
    units = [math.trunc(Fraction(v) * Fraction(2) ** shift) for v in values]
    out = np.zeros(k, dtype=np.float32)
    for j in range(k):
        exact = sum(u * Fraction(float(matrix[i, j])) for i, u in enumerate(units) if u)
        total = float(Fraction(exact) / Fraction(2) ** shift)
        out[j] = 0.0 if abs(total) < 2.0**-126 else np.float32(total)
    return out


@pytest.mark.parametrize(
    ("d", "ratio"),
    # k = 1 to 7 and 15 probe columns: every block the compiled pass takes, split as it
    # multiplies (up to zkdv._probe_pass._SPLIT_ONCE padded columns) and split once.
    [
        (1, 1.0),
        (128, 0.01),
        (250, 0.012),
        (7, 0.5),
        (5, 1.0),
        (300, 0.02),
        (513, 0.01),
        (700, 0.01),
        (1500, 0.01),
    ],
)
def test_probes_have_the_bits_of_exact_rational_arithmetic(path: str, d: int, ratio: float) -> None:
    rng = np.random.default_rng(d)
    # Nine rows: the compiled pass takes rows two at a time, so the last is alone.
    probes = ProbeSet.create([LeafSpec("w", "float32", (9, d))], ratio, bytes(16))
    values = _wide_rows(rng, 9, d)
    values[3] = (rng.standard_normal(d) * 2.0**-120).astype(np.float32)  # a small row
    values[3, 0] = np.float32(1e-40)  # with a subnormal that the flush removes
    values[4, -1] = np.inf  # a bad row first in its pair, and one second in its pair
    values[7, 0] = np.nan
    got = probes.project_rows(0, values)
    for row, probe in zip(values, got, strict=True):
        want = _exact_probe(row, probes.matrices[0])
        assert probe.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_only_the_dot_products_may_reorder_their_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled pass's dot products are vectorised (their sums are exact in any
    order); the split and the finish, whose roundings matter, are compiled strictly."""
    monkeypatch.setenv(probes_module.JIT_ENV, "1")
    kernel = probes_module._kernel()
    assert kernel is not None
    assert not kernel.targetoptions.get("fastmath")
    for name, flags in probes_module.PASS_HELPERS.items():
        helper = kernel.py_func.__globals__[name]
        assert set(helper.targetoptions.get("fastmath") or ()) == set(flags), name
        # The module keeps the Python function; only the kernel's globals see the
        # compiled one, and the helpers see each other compiled.
        assert getattr(probes_module, name) is not helper
        assert helper.py_func.__globals__ is kernel.py_func.__globals__
    relaxed = {name: flags for name, flags in probes_module.PASS_HELPERS.items() if flags}
    assert relaxed == dict.fromkeys(("_dots_4x4", "_dots_4x2"), probes_module.EXACT_SUM_FASTMATH)
    assert {"reassoc", "contract"} == probes_module.EXACT_SUM_FASTMATH
    # A relaxed helper computes what its Python function does, from slices and splitting.
    dots = kernel.py_func.__globals__["_dots_4x2"]
    slices = np.arange(20.0).reshape(4, 5) - 7
    q = np.stack([np.full(5, 2.0), np.arange(5.0)])
    compiled, python = np.zeros(16), np.zeros(16)
    dots(slices, 0, 0, False, (1.0, 1.0, 1.0), q, 0, compiled)
    probes_module._dots_4x2(slices, 0, 0, False, (1.0, 1.0, 1.0), q, 0, python)
    assert np.array_equal(compiled, python)
    assert compiled[0] == slices[0].sum() * 2 and compiled[13] == slices[3] @ q[1]
    rows = np.array([[1.5, -2.25, 0.5, 3.0, 1e-40], [0.0, 1.0, -1.0, 2.5, 0.75]], np.float32)
    dots(rows, 0, 1, True, (2.0**20, 2.0**20, 2.0**20), q, 0, compiled)
    # Rows of few bits: the high slices hold them whole (the subnormal flushed), the low
    # slices are zero.
    high = np.where(np.abs(rows) < 2.0**-126, 0.0, rows.astype(np.float64)) * 2.0**20
    assert compiled[[0, 1, 8, 9]].tolist() == (high @ q.T).ravel().tolist()
    assert compiled[[4, 5, 12, 13]].tolist() == [0.0] * 4


def test_without_numba_probes_take_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_numba(name: str, package: str | None = None) -> object:
        if name == "numba":
            raise ImportError("No module named 'numba'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_numba)
    monkeypatch.setattr(probes_module, "_kernel_state", {})
    monkeypatch.setenv(probes_module.JIT_ENV, "1")
    assert probes_module._kernel() is None
    probes = ProbeSet.create([LeafSpec("w", "float32", (5, 64))], 0.1, bytes(16))
    values = _wide_rows(np.random.default_rng(5), 5, 64)
    got = probes.project_rows(0, values)
    for row, probe in zip(values, got, strict=True):
        want = _exact_probe(row, probes.matrices[0])
        assert probe.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
