"""zkdv.jax.canonical: Optax updates with the same bits on every XLA CPU instruction set.

The instruction-set checks run this file as a script, once per ``--xla_cpu_max_isa``, in
subprocesses started together (the flag is read when XLA starts); each prints the
SHA-256 of every transform's outputs after five steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from zkdv.jax.canonical import CANONICAL_VERSION, NotCanonical, canonical, check  # noqa: E402

ISAS = ("SSE4_2", "AVX2", "AVX512")
STEPS = 5
ZERO = np.uint32(0)


def _weight_mask(params: Any) -> Any:
    return jax.tree.map(lambda p: p.ndim > 1, params)


TRANSFORMS: dict[str, Callable[[], Any]] = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2, mask=_weight_mask),
    "adam": lambda: optax.adam(1e-2),
    "adam_bfloat16_moments": lambda: optax.adam(1e-2, mu_dtype=jnp.bfloat16),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "clip_adamw_warmup_cosine": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-4)),
    ),
    "lion": lambda: optax.lion(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "inject_hyperparams_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2, weight_decay=1e-2
    ),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


def make_params() -> dict[str, Any]:
    """A matrix, a vector and a scalar.

    The matrix's dimensions are at least 128, so adafactor factors its second moment;
    adamw's mask decays the matrix only.
    """
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "w": rng.normal(size=(130, 128)).astype(np.float32),
            "b": rng.normal(size=(128,)).astype(np.float32) * 0.1,
        },
        "scale": np.float32(1.5),
    }


def make_grads(params: dict[str, Any]) -> list[Any]:
    """Five steps of gradients spanning magnitudes (clip_by_global_norm does clip)."""
    rng = np.random.default_rng(1)

    def leaf(p: np.ndarray) -> np.ndarray:
        g = rng.normal(size=np.shape(p)) * 10.0 ** rng.uniform(-6, 0, size=np.shape(p))
        return np.asarray(g, np.float32)

    return [jax.tree.map(leaf, params) for _ in range(STEPS)]


def step_function(tx: Any) -> Callable[..., Any]:
    def step(grads: Any, state: Any, params: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return updates, state, optax.apply_updates(params, updates)

    return step


def run_steps(
    name: str, *, canonical_path: bool, excess_precision: bool = True
) -> list[np.ndarray]:
    """Every output (updates, state, params) of ``STEPS`` jitted steps, as NumPy arrays.

    ``excess_precision=False`` makes plain XLA round every bfloat16 result as the program
    says (by default XLA CPU keeps some in float32).
    """
    tx = TRANSFORMS[name]()
    params = make_params()
    state = tx.init(params)
    step = step_function(tx)
    if canonical_path:
        compiled = jax.jit(lambda zero, *args: canonical(step, zero)(*args))
    else:
        options = {"xla_allow_excess_precision": excess_precision}
        plain = jax.jit(step, compiler_options=options)
        compiled = lambda zero, *args: plain(*args)  # noqa: E731
    outputs: list[np.ndarray] = []
    for grads in make_grads(params):
        updates, state, params = compiled(ZERO, grads, state, params)
        outputs += [np.asarray(leaf) for leaf in jax.tree.leaves((updates, state, params))]
    return outputs


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def fma_operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    a, b, c = (rng.normal(size=4096).astype(np.float32) for _ in range(3))
    return a, b, c


def relative_difference(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    """The largest difference relative to each output's largest magnitude."""
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        g, e = g.astype(np.float64), e.astype(np.float64)
        scale = max(float(np.max(np.abs(e), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(g - e), initial=0.0)) / scale)
    return worst


def worker(isa: str) -> None:
    """Under one instruction set: hashes of every canonical transform and of plain adamw.

    Under AVX-512 (where plain XLA fuses multiply-adds) it also measures how far each
    canonical transform is from plain Optax.
    """
    a, b, c = fma_operands()
    separately_rounded = (a * b) + c  # NumPy rounds the product, then the sum
    fused = jax.jit(lambda zero, a, b, c: canonical(lambda a, b, c: a * b + c, zero)(a, b, c))
    plain_fused = jax.jit(lambda a, b, c: a * b + c)
    outputs = {name: run_steps(name, canonical_path=True) for name in TRANSFORMS}
    result: dict[str, Any] = {
        "canonical": {name: digest(arrays) for name, arrays in outputs.items()},
        "plain_adamw": digest(run_steps("adamw", canonical_path=False)),
        "canonical_fma_matches_numpy": bool(
            np.array_equal(np.asarray(fused(ZERO, a, b, c)), separately_rounded)
        ),
        "plain_fma_matches_numpy": bool(
            np.array_equal(np.asarray(plain_fused(a, b, c)), separately_rounded)
        ),
    }
    if isa == "AVX512":
        result["relative_difference"] = {
            name: relative_difference(
                arrays, run_steps(name, canonical_path=False, excess_precision=False)
            )
            for name, arrays in outputs.items()
        }
    print("RESULT " + json.dumps(result))


@pytest.fixture(scope="module")
def isa_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # Here, not at the top: this file is also the children's script, run without tests/.
    from tests.processes import start, wait_all

    folder = tmp_path_factory.mktemp("isa")
    processes = {}
    for isa in ISAS:
        env = dict(os.environ, XLA_FLAGS=f"--xla_cpu_max_isa={isa}", JAX_PLATFORMS="cpu")
        processes[isa] = start(
            [sys.executable, __file__, isa], folder=folder, name=isa, merge=True, env=env
        )
    wait_all(list(processes.values()), timeout=300)
    results = {}
    for isa, process in processes.items():
        output = process.stdout()
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert process.returncode == 0 and lines, process.tail()
        results[isa] = json.loads(lines[-1].removeprefix("RESULT "))
    return results


def _host_has_fma() -> bool:
    try:
        return " fma " in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# --- Across instruction sets -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)  # isa_results gives its processes 300 s
def test_canonical_updates_are_identical_across_instruction_sets(isa_results):
    reference = isa_results[ISAS[0]]["canonical"]
    for isa in ISAS[1:]:
        assert isa_results[isa]["canonical"] == reference, isa


@pytest.mark.slow
@pytest.mark.skipif(not _host_has_fma(), reason="the host has no fused multiply-add")
@pytest.mark.timeout(600)  # isa_results gives its processes 300 s
def test_plain_optax_differs_across_instruction_sets(isa_results):
    # Without FMA (SSE4_2) and with it (AVX2, AVX-512) plain XLA rounds differently: a
    # broken fence would let the canonical hashes differ the same way.
    assert isa_results["SSE4_2"]["plain_adamw"] != isa_results["AVX512"]["plain_adamw"]


@pytest.mark.slow
@pytest.mark.skipif(not _host_has_fma(), reason="the host has no fused multiply-add")
@pytest.mark.timeout(600)  # isa_results gives its processes 300 s
def test_fence_with_a_runtime_zero_stops_fma_contraction(isa_results):
    assert isa_results["AVX512"]["canonical_fma_matches_numpy"]
    assert not isa_results["AVX512"]["plain_fma_matches_numpy"]  # XLA fused a*b+c
    assert isa_results["SSE4_2"]["plain_fma_matches_numpy"]


def test_fence_matches_separately_rounded_numpy_in_process():
    a, b, c = fma_operands()
    fused = jax.jit(lambda zero, a, b, c: canonical(lambda a, b, c: a * b + c, zero)(a, b, c))
    np.testing.assert_array_equal(np.asarray(fused(ZERO, a, b, c)), (a * b) + c, strict=True)


def _largest_fusion(leaves: int) -> int:
    """Lines of the largest fused computation XLA compiles for a canonical global-norm
    clipping of ``leaves`` parameter leaves."""
    clip = optax.clip_by_global_norm(1.0)
    grads = [jnp.full((16, 16), 0.5 + i, jnp.float32) for i in range(leaves)]
    update = jax.jit(lambda zero, g: canonical(lambda g: clip.update(g, clip.init(g))[0], zero)(g))
    text = update.lower(ZERO, grads).compile().as_text()
    computations = re.split(r"\n(?=\S)", text)
    return max(c.count("\n") for c in computations if c.startswith("%fused"))


def test_a_scalar_that_every_leaf_reads_is_computed_once_not_in_each_leaf():
    # The global norm (an exact sum's rounding per leaf, their sum, a square root, a
    # division) is a long scalar computation. Fused into its consumers, it grew with the
    # leaves, and the compile time with their square: a 38-leaf LM's AdamW with clipping
    # compiled for minutes. Each long scalar computation is now a region of its own.
    # Before: 1358 lines at 4 leaves, 6371 at 24; after: 256 and 340 (the sum of 24
    # scalars).
    assert _largest_fusion(24) < 2 * _largest_fusion(4)


def _adam(leaves: list[Any]) -> Any:
    tx = optax.adam(1e-2)

    def apply(grads: Any, state: Any, params: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(lambda zero, *a: canonical(apply, zero)(*a)), (leaves, tx.init(leaves), leaves)


def test_leaves_of_one_shape_share_one_copy_of_each_rule():
    # An optimizer applies one formula to every leaf; each fenced rule (a division, a
    # root) is a few hundred operations, and XLA compiled one copy per leaf (on a TPU
    # about 2 s a leaf). Leaves of one shape are now stacked: one copy per shape.
    # Before: 4,988 lines at 1 leaf, 19,328 at 16; after: 5,062 and 7,241.
    def lines(count: int) -> int:
        program, args = _adam([jnp.full((64, 64), 0.5 + i, jnp.float32) for i in range(count)])
        return len(program.lower(ZERO, *args).compile().as_text().splitlines())

    assert lines(16) < 2 * lines(1)


@pytest.mark.parametrize(
    "name",
    # AdamW and Adafactor (whose factored moments stack reductions) by default; the other
    # transforms' rules are the same stacked rules in other combinations.
    [n if n in ("adamw", "adafactor") else pytest.param(n, marks=pytest.mark.long)
     for n in sorted(TRANSFORMS)],
)  # fmt: skip
def test_stacked_leaves_have_the_bits_of_the_per_leaf_program(monkeypatch, name):
    # Two leaves of each shape (adafactor factors the matrices), three steps: the stacked
    # program (elementwise rules and reductions on stacks) against one copy per leaf.
    from zkdv.jax import _canonical_rules

    rng = np.random.default_rng(12)
    shapes = [(130, 128), (130, 128), (128,), (128,), (3,)]
    params = {f"p{i}": rng.normal(size=shape).astype(np.float32) for i, shape in enumerate(shapes)}
    grads = [jax.tree.map(lambda p: (rng.normal(size=p.shape) * 1e-2).astype(np.float32), params)
             for _ in range(3)]  # fmt: skip
    results = []
    for limit in (_canonical_rules.STACK_LIMIT, 0):  # the default, then no stacking
        monkeypatch.setattr(_canonical_rules, "STACK_LIMIT", limit)
        tx = TRANSFORMS[name]()
        program = jax.jit(lambda zero, *a, tx=tx: canonical(step_function(tx), zero)(*a))
        state, current, outputs = tx.init(params), params, []
        for g in grads:
            updates, state, current = program(ZERO, g, state, current)
            outputs += jax.tree.leaves((updates, state, current))
        results.append([np.asarray(o) for o in outputs])
    for together, alone in zip(*results, strict=True):
        np.testing.assert_array_equal(together, alone, strict=True)


def test_stack_limit_sets_the_limit_inside_its_block_and_restores_it():
    # The internal API bench/tpu_overhead.py sets the limit through (issue 57).
    from zkdv.jax import _canonical_rules
    from zkdv.jax.canonical import stack_limit

    default = _canonical_rules.STACK_LIMIT
    with stack_limit() as limit:
        assert limit == _canonical_rules.STACK_LIMIT == default
    with pytest.raises(RuntimeError), stack_limit(0) as limit:
        assert limit == _canonical_rules.STACK_LIMIT == 0
        raise RuntimeError
    assert default == _canonical_rules.STACK_LIMIT


# --- Against plain Optax ---------------------------------------------------------------

# Canonical and XLA's own rounding differ by an ulp here and there (FMA, exp, pow,
# summation order), which Adam-type updates amplify a little. Relative to each output's
# largest magnitude, after five steps, against plain Optax under AVX-512. Plain XLA is
# told to round bfloat16 results: by default it keeps bfloat16 products in float32,
# which moves adam_bfloat16_moments by up to 1e-2 (canonical rounds as the jaxpr says).
RTOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.timeout(600)  # isa_results gives its processes 300 s
def test_canonical_is_close_to_plain_optax(isa_results, name):
    assert isa_results["AVX512"]["relative_difference"][name] <= RTOL


# --- Tracing contexts ------------------------------------------------------------------


def test_it_gives_the_same_bits_eagerly_and_under_jit():
    # Every operation is rounded on its own, so XLA's fusion under jit changes nothing.
    def function(g, m):
        m = 0.9 * m + 0.1 * g
        return m, g / (jnp.sqrt(m * m) + 1e-8) - m * g

    rng = np.random.default_rng(6)
    g, m = (rng.normal(size=(8, 5)).astype(np.float32) for _ in range(2))
    eager = canonical(function, jnp.uint32(0))(g, m)
    jitted = jax.jit(lambda zero, g, m: canonical(function, zero)(g, m))(ZERO, g, m)
    for e, j in zip(eager, jitted, strict=True):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j), strict=True)


def test_it_works_under_jax_export():
    tx = TRANSFORMS["adamw"]()
    params = make_params()
    state = tx.init(params)
    grads = make_grads(params)[0]
    step = step_function(tx)
    tree = jax.tree.structure((grads, state, params))

    def program(zero, *leaves):  # flat: optax's state types have no export serialization
        return jax.tree.leaves(canonical(step, zero)(*jax.tree.unflatten(tree, leaves)))

    args = (ZERO, *jax.tree.leaves((grads, state, params)))
    shapes = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
    exported = jax.export.export(jax.jit(program))(*shapes)
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(*args)
    expected = jax.jit(program)(*args)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e), strict=True)


def test_float64_parameters_under_x64():
    with jax.enable_x64(True):
        tx = TRANSFORMS["adamw"]()
        params = jax.tree.map(lambda p: np.asarray(p, np.float64), make_params())
        grads = jax.tree.map(lambda p: np.asarray(p, np.float64), make_grads(params)[0])
        state = tx.init(params)
        step = step_function(tx)
        got = jax.jit(lambda zero, *args: canonical(step, zero)(*args))(ZERO, grads, state, params)
        expected = jax.jit(step)(grads, state, params)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-13, atol=1e-300)


def test_control_flow_is_interpreted_inside():
    @jax.custom_vjp
    def doubled(x):
        return x * 2.0

    doubled.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))

    def function(x):
        def body(carry, row):
            carry = carry * 0.5 + jnp.exp(row)
            return carry, jnp.tanh(carry)

        carry, ys = lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)
        _, total = lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.25 + c[0]), (0, carry)
        )
        picked = lax.cond(total.sum() > 0, jnp.log1p, jnp.expm1, jnp.abs(total))
        smooth = jax.checkpoint(jax.nn.softplus)(x)  # checkpoint, custom_jvp
        return ys, jax.jit(jnp.sin)(picked), doubled(smooth)

    x = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
    got = jax.jit(lambda zero, x: canonical(function, zero)(x))(ZERO, x)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(function)(x)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-7)


# --- The rules -------------------------------------------------------------------------


def _canonical_jit(function: Callable[..., Any]) -> Any:
    return jax.jit(lambda zero, *args: canonical(function, zero)(*args))


def float32(values: list[Any]) -> np.ndarray:
    return np.array(values, np.float32)


@pytest.mark.parametrize(
    ("name", "function", "reference", "low", "high", "ulps"),
    [
        ("exp", jnp.exp, np.exp, -87.0, 88.0, 1),  # float32 results stay normal
        ("exp2", jnp.exp2, np.exp2, -125.0, 127.0, 1),
        ("log", jnp.log, np.log, 1e-30, 1e30, 2),
        ("log1p", jnp.log1p, np.log1p, -0.99, 10.0, 3),
        ("expm1", jnp.expm1, np.expm1, -5.0, 5.0, 4),
        ("sin", jnp.sin, np.sin, -100.0, 100.0, 2),
        ("cos", jnp.cos, np.cos, -100.0, 100.0, 2),
        ("tan", jnp.tan, np.tan, -1.5, 1.5, 4),
        ("tanh", jnp.tanh, np.tanh, -10.0, 10.0, 3),
        ("logistic", jax.nn.sigmoid, lambda v: 1.0 / (1.0 + np.exp(-v)), -80.0, 80.0, 2),
        ("sinh", jnp.sinh, np.sinh, -80.0, 80.0, 3),
        ("cosh", jnp.cosh, np.cosh, -80.0, 80.0, 3),
        ("sqrt", jnp.sqrt, np.sqrt, 0.0, 1e30, 0),  # correctly rounded
        ("rsqrt", lax.rsqrt, lambda v: 1.0 / np.sqrt(v), 1e-30, 1e30, 1),  # two roundings
        # exp(y log x): the error grows with |y log x| (here up to 17).
        ("pow", lambda v: v**0.37, lambda v: v ** float(np.float32(0.37)), 1e-20, 1e20, 40),
    ],
)
def test_float32_formulas_are_within_a_few_ulps(name, function, reference, low, high, ulps):
    """Version 2 evaluates float32 formulas in float32 (a TPU has no IEEE float64): as
    accurate as a float32 libm, and the same bits everywhere."""
    rng = np.random.default_rng(4)
    if low > 0:
        x = np.exp(rng.uniform(np.log(low), np.log(high), 20000))
    else:
        x = rng.uniform(low, high, 20000)
    x = x.astype(np.float32)
    got = np.asarray(_canonical_jit(function)(ZERO, x))
    with np.errstate(over="ignore"):
        expected = reference(x.astype(np.float64)).astype(np.float32)
    distance = np.abs(got.view(np.int32).astype(np.int64) - expected.view(np.int32))
    assert int(distance.max()) <= ulps, name
    assert np.mean(distance == 0) > (0.999 if ulps == 0 else 0.4 if ulps <= 4 else 0.1), name


def _random_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Float32 across the whole exponent range, signed, with a third near 1."""
    x = np.ldexp(rng.uniform(1, 2, n), rng.integers(-125, 127, n)).astype(np.float32)
    x[rng.random(n) < 0.5] *= -1
    near = rng.random(n) < 0.3
    x[near] = rng.standard_normal(int(near.sum())).astype(np.float32)
    return x


def _flushed(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    tiny = np.abs(x) <= np.float32(2.0**-126)
    x[tiny] = np.copysign(np.float32(0), x[tiny])
    return x


SPECIAL = float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3e38, -1e-37, 2.0**-126])


@pytest.mark.parametrize("inaccurate", [False, True])
def test_division_and_square_root_are_ieee_from_the_bits(monkeypatch, inaccurate):
    """Float32 div and sqrt are correctly rounded with no float64 (v2), also when the
    backend's own division and square root, which only propose a result, are several
    ulps off (a TPU's are off by one to two ulps for some operands)."""
    if inaccurate:
        from zkdv.jax import _canonical_arithmetic as arithmetic

        def off(exact: Any) -> Any:
            def wrong(*args: Any) -> Any:
                value = exact(*args)
                bits = lax.bitcast_convert_type(value, jnp.int32)
                # Up to 6 ulps either way, by the low bits of the operand.
                shift = (lax.bitcast_convert_type(args[0], jnp.int32) & 15) - 7
                return lax.bitcast_convert_type(bits + jnp.clip(shift, -6, 6), jnp.float32)

            return wrong

        monkeypatch.setattr(arithmetic, "_approximate_division", off(lax.div))
        monkeypatch.setattr(arithmetic, "_approximate_sqrt", off(lax.sqrt))
    rng = np.random.default_rng(8)
    a, b = _flushed(_random_floats(rng, 1 << 16)), _flushed(_random_floats(rng, 1 << 16))
    grid_a, grid_b = (g.ravel() for g in np.meshgrid(SPECIAL, SPECIAL))
    # The fence flushes inputs up to the smallest normal too (2^-126 is one).
    a, b = _flushed(np.concatenate([a, grid_a])), _flushed(np.concatenate([b, grid_b]))
    with np.errstate(all="ignore"):
        quotient = _flushed((a.astype(np.float64) / b).astype(np.float32))
        root = _flushed(np.sqrt(a.astype(np.float64)).astype(np.float32))
    got_q = np.asarray(_canonical_jit(lambda x, y: x / y)(ZERO, a, b))
    got_r = np.asarray(_canonical_jit(jnp.sqrt)(ZERO, a))
    for got, expected in ((got_q, quotient), (got_r, root)):
        nan = np.isnan(expected)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
        assert list(np.unique(got[nan].view(np.uint32))) == [0x7FC00000]


def _lowered_text(function: Callable[..., Any], *args: Any, platforms: tuple[str, ...]) -> str:
    leaves, tree = jax.tree.flatten(args)

    def program(zero: Any, *flat: Any) -> Any:  # flat: optax's state types do not export
        return jax.tree.leaves(canonical(function, zero)(*jax.tree.unflatten(tree, flat)))

    shapes = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in (ZERO, *leaves)]
    exported = jax.export.export(jax.jit(program), platforms=platforms)(*shapes)
    return str(exported.mlir_module())


@pytest.mark.parametrize("name", ["adamw", "clip_adamw_warmup_cosine", "adafactor"])
def test_the_update_lowers_for_a_tpu_without_float64(name):
    """CI has no TPU: lowering for one catches what its compiler would refuse, and a
    float64 in the program (a TPU emulates it, inexactly) fails here."""
    tx = TRANSFORMS[name]()
    params = make_params()
    text = _lowered_text(
        step_function(tx), make_grads(params)[0], tx.init(params), params, platforms=("tpu",)
    )
    assert "f64" not in text and "i64" not in text and "ui64" not in text


def test_a_division_by_a_runtime_scalar_is_the_correctly_rounded_quotient():
    """Optax's bias correction divides by a runtime scalar, which XLA's simplifier turns
    into a multiplication by its reciprocal: not the IEEE quotient, in the format it is
    done in. Float32 is divided in float64, where that still rounds alike; float64's
    divisor is kept from being a broadcast."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1 << 16) * np.exp(rng.uniform(-30.0, 30.0, 1 << 16))
    divisors = 1.0 - 0.999 ** np.arange(1.0, 9.0)
    divide = _canonical_jit(lambda a, b: a / b)
    narrow = x.astype(np.float32)
    for c in divisors.astype(np.float32):
        got = np.asarray(divide(ZERO, narrow, c))
        expected = (narrow.astype(np.float64) / np.float64(c)).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    with jax.enable_x64(True):
        for c in divisors:
            got = np.asarray(divide(ZERO, x, c))
            assert got.dtype == np.float64
            np.testing.assert_array_equal(got.view(np.uint64), (x / c).view(np.uint64))


TINY = 10.0 ** -np.arange(300)


@pytest.mark.parametrize(
    ("function", "reference", "x"),
    [
        (jnp.exp, np.exp, np.linspace(-740.0, 709.0, 5001)),
        (jnp.log, np.log, np.exp(np.linspace(-700.0, 700.0, 5001))),
        (jnp.log1p, np.log1p, np.concatenate([np.linspace(-0.99, 5, 2001), TINY])),
        (jnp.expm1, np.expm1, np.concatenate([np.linspace(-30, 30, 2001), TINY])),
        (jnp.sin, np.sin, np.linspace(-1e6, 1e6, 5001)),
        (jnp.cos, np.cos, np.linspace(-1e6, 1e6, 5001)),
        (jnp.tanh, np.tanh, np.linspace(-20, 20, 5001)),
    ],
)
def test_float64_formulas_are_accurate(function, reference, x):
    with jax.enable_x64(True):
        got = np.asarray(_canonical_jit(function)(ZERO, x))
    expected = reference(x)
    # Relative error about 1e-15; sin and cos of large arguments lose what the argument's
    # own rounding to float64 implies anyway, so they are held to an absolute bound.
    np.testing.assert_allclose(got, expected, rtol=2e-15, atol=1e-16)


def test_pow_follows_c99_special_cases():
    x = np.array([0.0, -0.0, -0.0, 2.0, -2.0, -2.0, -8.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 0.5])
    y = np.array([2.0, 3.0, -3.0, 0.5, 3.0, 2.0, 1 / 3, np.nan, np.inf, 0.0, -1.0, 3.0, np.inf])
    x, y = x.astype(np.float32), y.astype(np.float32)
    got = np.asarray(_canonical_jit(lambda a, b: a**b)(ZERO, x, y))
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = np.power(x.astype(np.float64), y.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got, expected, strict=True)
    numbers = ~np.isnan(expected)  # NumPy's NaN here is negative, the canonical one not
    assert np.array_equal(np.signbit(got)[numbers], np.signbit(expected)[numbers])


def test_integer_powers_use_binary_powering():
    base = np.float32(0.999)  # Adam's bias correction: beta ** count
    counts = np.arange(-40, 2000, 7, dtype=np.int32)
    got = np.asarray(_canonical_jit(lambda c: base**c)(ZERO, counts))
    # Each of at most 2 * 11 products rounded once in float32 (a half ulp, 6e-8).
    np.testing.assert_allclose(got, np.float64(base) ** counts.astype(np.float64), rtol=1.4e-6)
    x = float32([3.1, -1e19, 1e-25])
    squares = np.asarray(_canonical_jit(lambda v: v**2)(ZERO, x))
    np.testing.assert_array_equal(squares, x * x)  # one correctly rounded product


def test_sums_do_not_depend_on_the_order_of_terms():
    rng = np.random.default_rng(5)
    x = (rng.normal(size=100_003) * 10.0 ** rng.uniform(-20, 20, 100_003)).astype(np.float32)
    total = _canonical_jit(jnp.sum)
    got = np.asarray(total(ZERO, x))
    for permutation in (rng.permutation(x.size), np.argsort(x), np.argsort(-np.abs(x))):
        np.testing.assert_array_equal(np.asarray(total(ZERO, x[permutation])), got)
    assert got == np.float32(math.fsum(x.astype(np.float64)))  # the exact sum, rounded
    table = x[:100_000].reshape(1000, 100)
    rows = np.asarray(_canonical_jit(lambda v: jnp.sum(v, axis=1))(ZERO, table))
    np.testing.assert_array_equal(rows, float32([math.fsum(r) for r in table.astype(float)]))
    assert np.isnan(total(ZERO, float32([1.0, np.inf, -np.inf])))
    assert total(ZERO, float32([1.0, np.inf])) == np.inf


def test_cumulative_operations_run_element_after_element():
    x = np.random.default_rng(7).normal(size=(300, 3)).astype(np.float32)
    forward = _canonical_jit(lambda v: jnp.cumsum(v, axis=0))(ZERO, x)
    np.testing.assert_array_equal(forward, np.add.accumulate(x, axis=0))  # NumPy: in order
    backward = _canonical_jit(lambda v: lax.cumprod(v, axis=0, reverse=True))(ZERO, x[:20])
    np.testing.assert_array_equal(backward, np.multiply.accumulate(x[19::-1], axis=0)[::-1])


def test_fence_flushes_subnormals_keeping_the_sign_and_canonicalizes_nan():
    tiny = np.float32(2.0**-126)  # the smallest normal float32
    x = float32([2 * tiny, -2 * tiny, 1.5 * tiny, -1.5 * tiny, 1.0])
    halved = np.asarray(_canonical_jit(lambda v: v * 0.5)(ZERO, x))
    # tiny itself is flushed too (see the module docstring), 0.75 tiny is subnormal.
    np.testing.assert_array_equal(halved, float32([0.0, -0.0, 0.0, -0.0, 0.5]))
    assert list(np.signbit(halved)) == [False, True, False, True, False]
    inputs = float32([tiny / 2, -tiny / 2, tiny, 3 * tiny])
    same = np.asarray(_canonical_jit(lambda v: v)(ZERO, inputs))
    assert list(same.view(np.uint32)) == [0, 0x80000000, 0, (3 * tiny).view(np.uint32)]
    nans = np.asarray(_canonical_jit(lambda v: -(v / v))(ZERO, float32([0.0, np.inf])))
    assert list(nans.view(np.uint32)) == [0x7FC00000, 0x7FC00000]


def test_max_and_min_order_signed_zeros_and_propagate_nan():
    a = float32([0.0, -0.0, np.nan, 1.0, -0.0])
    b = float32([-0.0, 0.0, 1.0, np.nan, -0.0])
    high = np.asarray(_canonical_jit(jnp.maximum)(ZERO, a, b))
    low = np.asarray(_canonical_jit(jnp.minimum)(ZERO, a, b))
    assert list(high.view(np.uint32)) == [0, 0, 0x7FC00000, 0x7FC00000, 0x80000000]
    negative_zero, nan = 0x80000000, 0x7FC00000
    assert list(low.view(np.uint32)) == [negative_zero, negative_zero, nan, nan, negative_zero]
    zeros = float32([-0.0, 0.0, -0.0])
    assert not np.signbit(_canonical_jit(jnp.max)(ZERO, zeros))
    assert np.signbit(_canonical_jit(jnp.min)(ZERO, zeros))
    assert np.isnan(_canonical_jit(jnp.min)(ZERO, float32([1.0, np.nan])))


# --- What is not canonical --------------------------------------------------------------


def test_dot_general_is_not_canonical():
    a = jnp.ones((3, 4), jnp.float32)
    with pytest.raises(NotCanonical, match=r"'dot_general'.*order of additions"):
        canonical(lambda a: a @ a.T, jnp.uint32(0))(a)
    # Also in optax's one-cycle schedules (indicator.dot(values)).
    schedule = optax.cosine_onecycle_schedule(100, 1e-2)
    reason = check(schedule, jnp.int32(3))
    assert reason is not None and "'dot_general'" in reason
    reason = check(lambda a: a @ a.T, a)
    assert reason is not None and "dot_general" in reason and CANONICAL_VERSION in reason
    # Integer arithmetic is exact, so an integer product is fine.
    assert check(lambda a: a @ a.T, jnp.ones((3, 4), jnp.int32)) is None


def test_check_accepts_the_optax_update():
    tx = TRANSFORMS["clip_adamw_warmup_cosine"]()
    params = make_params()
    assert check(tx.update, make_grads(params)[0], tx.init(params), params) is None


def test_unknown_primitives_are_named():
    with pytest.raises(NotCanonical, match="'erf'"):
        canonical(jax.scipy.special.erf, jnp.uint32(0))(jnp.ones(3))


def test_zero_must_be_a_uint32_scalar():
    with pytest.raises(ValueError, match="uint32 scalar"):
        canonical(jnp.exp, 0)
    with pytest.raises(ValueError, match="uint32 scalar"):
        canonical(jnp.exp, jnp.zeros(2, jnp.uint32))


def test_zero_must_be_an_input_of_the_traced_program():
    # A constant zero is folded by XLA, and the fences with it.
    with pytest.raises(ValueError, match="argument"):
        jax.jit(canonical(jnp.exp, jnp.uint32(0)))(jnp.ones(3))


if __name__ == "__main__":
    worker(sys.argv[1])
