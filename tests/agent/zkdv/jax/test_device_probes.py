"""The device probes (``zkdv.jax.device_probes``): the host's bits for every input.

The device path computes probes with integer arithmetic only (int8 digit products,
multi-limb sums, the host's float64-then-float32 rounding emulated), so that it lowers
and runs on a TPU. These tests compare it bit for bit with ``ProbeSet.project_rows`` on
adversarial rows (huge and tiny exponents, a row element near ``2**127``, subnormals,
infinities and NaNs, zeros of both signs, cancellations, rows of 1 to 5000 elements,
bfloat16 and float16 leaves), on hand-built rounding ties, and check that the program
lowers for TPU without float64. Each row length is one XLA compile, so the lengths are
few and the rows many.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zkdv.jax.device_probes import (
    BLOCK_TERMS,
    MAX_TERMS,
    DeviceProbes,
    IntegerMatrix,
    matrix_digits,
    project,
)
from zkdv.merkle import LeafSpec
from zkdv.probes import ProbeSet, exact_matrix, slice_width

ROWS = 8
WIDTHS = (1, 2, 3, 31, 128, 129, 1000, 2049, 5000)
KINDS = (
    "bits",
    "normal",
    "huge",
    "tiny",
    "subnormal",
    "zeros",
    "nonfinite",
    "narrow",
    "sparse",
    "cancel",
)
#: A 64-bit element type in StableHLO text (``tensor<f64>``, ``tensor<3xi64>``), not an
#: attribute's ``array<i64: ...>``.
WIDE_TYPES = re.compile(r"[x<](?:f64|i64|ui64)>")
MAX_FLOAT = np.float32(np.finfo(np.float32).max)

_project = jax.jit(project)


def _host(rows: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``ProbeSet.project_rows`` of float32 ``rows`` by an exact ``matrix``."""
    r, d = rows.shape
    k = matrix.shape[1]
    spec = LeafSpec("leaf", "float32", (r, d))
    probes = ProbeSet((spec,), (k - 0.5) / d, bytes(16), (matrix,), (None,))
    return probes.project_rows(0, rows.astype(np.float32))


def _device(rows: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    return np.asarray(_project(jnp.asarray(rows), matrix_digits(matrix)))


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    differ = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert differ.size == 0, (
        f"{differ.size} probes differ, first at {differ[0]}: "
        f"{got.ravel()[differ[0]]!r} != host {want.ravel()[differ[0]]!r}"
    )


def _bits(rng: np.random.Generator, d: int, low: int, high: int) -> np.ndarray:
    """Random float32 values with exponent fields in ``[low, high]`` and random signs
    and significands."""
    fields = rng.integers(low, high, d, endpoint=True).astype(np.uint32)
    words = (
        (rng.integers(0, 2, d).astype(np.uint32) << np.uint32(31))
        | (fields << np.uint32(23))
        | rng.integers(0, 1 << 23, d).astype(np.uint32)
    )
    return words.view(np.float32)


def _row(rng: np.random.Generator, kind: str, d: int) -> np.ndarray:
    """One adversarial float32 row of ``d`` elements."""
    if kind == "bits":
        return _bits(rng, d, 0, 254)
    if kind == "normal":
        return (rng.standard_normal(d) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
    if kind == "huge":
        row = (rng.standard_normal(d) * 1e37).astype(np.float32)
        row[rng.integers(d)] = MAX_FLOAT * rng.choice([-1, 1]) * np.float32(rng.random())
        row[rng.integers(d)] = MAX_FLOAT * rng.choice([-1, 1])
        return row
    if kind == "tiny":
        return _bits(rng, d, 0, 30)
    if kind == "subnormal":
        return _bits(rng, d, 0, 0)
    if kind == "zeros":
        return np.where(rng.random(d) < 0.5, np.float32(-0.0), np.float32(0.0))
    if kind == "nonfinite":
        row = rng.standard_normal(d).astype(np.float32)
        row[rng.integers(d)] = rng.choice([np.inf, -np.inf, np.nan])
        return row
    if kind == "narrow":
        top = int(rng.integers(4, 254))
        return _bits(rng, d, top - 3, top)
    if kind == "sparse":
        row = np.zeros(d, np.float32)
        for field in (int(rng.integers(150, 254)), int(rng.integers(1, 100)), 0):
            row[rng.integers(d)] = _bits(rng, 1, field, field)[0]
        return row
    # "cancel": values and their negatives with a small perturbation; results land
    # near zero, around the flush threshold.
    half = _bits(rng, d, 1, 254)
    row = np.where(np.arange(d) % 2 == 0, half, -np.roll(half, 1))
    row[rng.integers(d)] = _bits(rng, 1, 1, 60)[0]
    return row.astype(np.float32)


def _matrix(rng: np.random.Generator, d: int, kind: str) -> np.ndarray:
    """An exact probe matrix ``(d, min(d, 5))``: orthonormal as ``ProbeSet.create``
    draws them, or columns of wildly different scales (exponents -120 to 120, a zero
    column, entries that ``exact_matrix`` flushes or truncates)."""
    k = min(d, 5)
    if kind == "orthonormal":
        q, r = np.linalg.qr(rng.standard_normal((d, k)))
        return exact_matrix((q * np.sign(np.diag(r))).astype(np.float32))
    scales = 2.0 ** rng.integers(-120, 120, k).astype(np.float64)
    columns = (rng.standard_normal((d, k)) * scales).astype(np.float32)
    columns[:, 0] = 0.0
    columns[rng.integers(d), -1] = np.float32(1e-40)
    return exact_matrix(columns)


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.sampled_from(WIDTHS),
    seed=st.integers(0, 2**32 - 1),
    kinds=st.lists(st.sampled_from(KINDS), min_size=ROWS, max_size=ROWS),
    matrix_kind=st.sampled_from(("orthonormal", "wide")),
)
def test_adversarial_rows_give_the_host_bits(
    d: int, seed: int, kinds: list[str], matrix_kind: str
) -> None:
    rng = np.random.default_rng(seed)
    rows = np.stack([_row(rng, kind, d) for kind in kinds])
    matrix = _matrix(rng, d, matrix_kind)
    _same(_device(rows, matrix), _host(rows, matrix))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.sampled_from((1, 33, 300)),
    dtype=st.sampled_from((ml_dtypes.bfloat16, np.float16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_half_precision_rows_are_widened_exactly(d: int, dtype: Any, seed: int) -> None:
    """Every bit pattern of bfloat16 and float16 (subnormals, infinities, NaNs):
    widened from its bits as the host's ``astype(float32)`` widens it."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 16, (ROWS, d)).astype(np.uint16)
    # Most rows finite (a random 16-bit word is an infinity or NaN 1 time in 32), some
    # all-subnormal, one all negative zeros.
    words[: ROWS // 2] &= np.uint16(0xBBFF)
    words[ROWS // 2] &= np.uint16(0x807F if dtype == ml_dtypes.bfloat16 else 0x83FF)
    words[-1] = np.uint16(0x8000)
    rows = words.view(dtype)
    matrix = _matrix(rng, d, "orthonormal")
    got = np.asarray(_project(jnp.asarray(rows), matrix_digits(matrix)))
    _same(got, _host(rows.astype(np.float32), matrix))


def test_rounding_ties_and_the_double_rounding_are_the_hosts() -> None:
    """Hand-built sums (``d = 3``, ``w = 25``, matrix column ``[1, 2**-24, -2**-24]``):
    ties of the float32 rounding both ways, a tie that only the float64 rounding
    creates (the host rounds twice: ``1 + 2**-23 + 2**-24 - 2**-60`` becomes
    ``1 + 2**-22``, not the once-rounded ``1 + 2**-23``), overflow to infinity at the
    float32 tie below ``2**128``, and the flush just below ``2**-126``."""
    f = np.float32
    one = f(1.0)
    odd = f(1.0 + 2.0**-23)
    matrix = np.array([[1.0, 1.0], [2.0**-24, 2.0**-24], [-(2.0**-24), -(2.0**-24)]], f)
    assert np.array_equal(exact_matrix(matrix), matrix) and slice_width(3) == 25
    rows = np.array(
        [
            [one, one, f(0)],  # 1 + 2**-24: a tie, to even (down)
            [odd, one, f(0)],  # 1 + 2**-23 + 2**-24: a tie, to even (up)
            [odd, one, f(2.0**-36)],  # below the tie by 2**-60: float64 makes it one
            [one, one, f(-(2.0**-36))],  # above a tie by 2**-60: float64 makes it one
            [MAX_FLOAT, f(2.0**127), f(0)],  # max + 2**103: the tie below 2**128
            [MAX_FLOAT, f(2.0**126), f(0)],  # max + 2**102: stays finite
            [f(2.0**-126), f(0), f(2.0**-102)],  # 2**-126 - 2**-126: exactly zero
            [f(2.0**-126), f(0), f(2.0**-126)],  # just below 2**-126: flushed to +0
        ],
        f,
    )
    want = np.array([1.0, 1.0 + 2.0**-22, 1.0 + 2.0**-22, 1.0, np.inf, MAX_FLOAT, 0.0, 0.0], f)
    host = _host(rows, matrix)
    assert np.array_equal(host[:, 0].view(np.uint32), want.view(np.uint32)), host[:, 0]
    _same(_device(rows, matrix), host)


def _near_ties(rng: np.random.Generator, count: int) -> list[int]:
    """Signed integers of up to 80 bits, most of them at, or one unit of some lower bit
    away from, a tie of the 24-bit rounding, of the 53-bit one, or of both at once (a
    24-bit tie plus or minus half a 53-bit unit: where rounding twice and rounding once
    differ, also by bits below the 64 the device rounds from)."""
    out = []
    for _ in range(count):
        length = int(rng.integers(1, 81))
        value = int(rng.integers(0, 2**62)) | (1 << 62)
        value = value >> (63 - length) if length < 63 else value << (length - 63)
        kind = int(rng.integers(0, 5))
        cut24, cut53 = length - 24, length - 53
        if kind and cut24 > 0:
            value = value >> cut24 << cut24
            if kind != 2:  # 1, 3, 4: a tie of the 24-bit rounding
                value |= 1 << (cut24 - 1)
            if kind >= 2 and cut53 > 0:  # 2, 3, 4: half a 53-bit unit around it
                value += int(rng.choice([-1, 1])) * (1 << (cut53 - 1))
            lowest = cut53 - 1 if kind >= 2 else cut24 - 1
            if kind != 4 and lowest > 0:  # one unit of a lower bit
                value += int(rng.choice([-1, 1])) * (1 << int(rng.integers(0, lowest)))
        out.append(value * int(rng.choice([-1, 1])))
    return out


def _reference(value: int, scale: int) -> np.uint32:
    """The host's finish of an exact sum ``value * 2**scale``: float64, then float32."""
    wide = math.ldexp(float(value), scale)  # int -> float rounds to nearest even
    if abs(wide) < 2.0**-126:
        return np.uint32(0)
    with np.errstate(over="ignore"):
        return np.float32(wide).view(np.uint32)


def test_the_finish_rounds_exact_sums_as_the_host() -> None:
    """Steps 6-7 alone on sums the products rarely make: ties of either rounding, one
    unit of any lower bit around them, scales from deep in the flush to overflow."""
    from zkdv.jax.device_probes import _finish

    rng = np.random.default_rng(17)
    # 2**B - 1 at the scale that puts it just below 2**-126: the 53-bit rounding
    # carries it up to 2**-126 (kept) when B > 53; exact and flushed when B <= 53.
    edges = [(sign * (2**b - 1), -126 - b) for b in range(50, 81) for sign in (1, -1)]
    values = [0, 1, -1, 2**80 - 1, -(2**79), *(v for v, _ in edges), *_near_ties(rng, 4000)]
    scales = rng.integers(-215, 130, len(values))
    scales[5 : 5 + len(edges)] = [k for _, k in edges]
    limbs = np.zeros((7, len(values)), np.int32)
    for i, value in enumerate(values):
        for j in range(7):
            limbs[j, i] = ((abs(value) >> (16 * j)) & 0xFFFF) * (1 if value >= 0 else -1)
    bad = np.arange(len(values)) % 97 == 5
    got = np.asarray(jax.jit(_finish)(limbs, scales.astype(np.int32), bad)).view(np.uint32)
    want = [
        np.uint32(0x7FC00000) if b else _reference(v, int(k))
        for v, k, b in zip(values, scales, bad, strict=True)
    ]
    differ = [i for i, w in enumerate(want) if got[i] != w]
    assert not differ, [(values[i], int(scales[i]), hex(got[i]), hex(want[i])) for i in differ[:5]]


def test_rows_longer_than_one_int32_sum() -> None:
    """More than :data:`BLOCK_TERMS` elements: two blocks of products, each exact."""
    d = BLOCK_TERMS + 5
    rng = np.random.default_rng(3)
    rows = np.stack([_row(rng, kind, d) for kind in ("narrow", "normal", "cancel")])
    rows[0] = np.abs(rows[0])  # every product of one sign: the largest sums
    matrix = exact_matrix(np.abs(rng.standard_normal((d, 1))).astype(np.float32))
    _same(_device(rows, matrix), _host(rows, matrix))


def test_too_long_rows_and_inexact_matrices_are_refused() -> None:
    spec = jax.ShapeDtypeStruct((1, MAX_TERMS + 1), jnp.float32)  # type: ignore[no-untyped-call]
    wide = IntegerMatrix(
        jax.ShapeDtypeStruct((MAX_TERMS + 1, 3), jnp.int8),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((1,), jnp.int32),  # type: ignore[no-untyped-call]
    )
    with pytest.raises(ValueError, match=f"at most {MAX_TERMS}"):
        jax.eval_shape(project, spec, wide)
    with pytest.raises(ValueError, match="not an exact matrix"):
        matrix_digits(np.array([[1.0], [2.0**-30]], np.float32))
    with pytest.raises(ValueError, match="infinity or NaN"):
        matrix_digits(np.array([[np.inf]], np.float32))


def _tree() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [
        rng.standard_normal((80, 40)).astype(np.float32),  # more rows than probed
        rng.standard_normal((40,)).astype(np.float32),
        rng.standard_normal((6, 40)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((6, 40)).astype(np.float16),
        np.array(3.0, np.float32),
        np.zeros((4, 0), np.float32),
    ]


@pytest.mark.parametrize("x64", [False, True])
def test_device_probes_of_a_tree_hold_no_64_bit_type(x64: bool) -> None:
    """x64 off (JAX's default) or on (a user's choice): the program holds no 64-bit
    type, not even a constant, and gives the host's bits."""
    with jax.enable_x64(x64):
        arrays = _tree()
        probes = ProbeSet.create(
            [LeafSpec.of(str(i), a) for i, a in enumerate(arrays)], 0.1, b"seed" * 4
        )
        device = DeviceProbes(probes)
        leaves = [jnp.asarray(a) for a in arrays]
        flat = np.asarray(device(leaves))
        text = device.program().lower(leaves, device.matrices, device.selections).as_text()
    for want, got in zip(probes.project_all(arrays), device.split(flat), strict=True):
        _same(got, want)
    assert not WIDE_TYPES.findall(text)


def test_the_probe_program_lowers_for_tpu() -> None:
    """``jax.export`` for TPU works on a CPU-only machine: a lowering regression of the
    probe program (an operation TPU's lowering refuses, or float64 creeping in) fails
    here, in CI, rather than at a TPU run's first step."""
    arrays = _tree()
    probes = ProbeSet.create(
        [LeafSpec.of(str(i), a) for i, a in enumerate(arrays)], 0.1, b"seed" * 4
    )
    device = DeviceProbes(probes)

    def spec(x: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)  # type: ignore[no-untyped-call]

    leaves = [spec(a) for a in arrays]
    matrices = jax.tree.map(spec, device.matrices)
    selections = jax.tree.map(spec, device.selections)
    exported = jax.export.export(device.program(), platforms=("tpu",))(leaves, matrices, selections)
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    assert not WIDE_TYPES.findall(text)
    assert "stablehlo.dot_general" in text and "xi8>" in text
    assert exported.out_avals[0].shape == (probes.floats,)


def test_runs_of_one_layout_share_one_probe_program() -> None:
    """The probe seed (the matrices, the probed rows) is data, not program: two runs of
    one layout lower to the same program, so XLA's persistent cache compiles it once for
    every run and every replay (on a TPU, 10 s a process before)."""
    arrays = _tree()
    specs = [LeafSpec.of(str(i), a) for i, a in enumerate(arrays)]
    leaves = [jnp.asarray(a) for a in arrays]
    texts = []
    for seed in (b"seed" * 4, b"other seed 16 by"):
        device = DeviceProbes(ProbeSet.create(specs, 0.1, seed))
        texts.append(device.program().lower(leaves, device.matrices, device.selections).as_text())
    assert any(sel is not None for sel in device.selections)  # rows are sampled here
    assert texts[0] == texts[1]
