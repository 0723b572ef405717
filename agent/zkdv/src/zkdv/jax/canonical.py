"""Evaluate small elementwise JAX functions (an Optax update) bit for bit reproducibly.

:func:`canonical` traces a function to a jaxpr and evaluates it equation by equation
with the rules below, emitting ordinary JAX operations: the result works under
``jax.jit``, inside a larger traced program and under ``jax.export``, and its float
results are the same bits on every XLA CPU instruction set (``--xla_cpu_max_isa`` =
SSE4_2, AVX, AVX2, AVX512) and, by construction, on GPUs. ZKDV runs an optimizer's update
this way so that the lab's training and the platform's replay on other hardware compute
the same post-update state from the same committed gradient.

Usage (``tx`` an ``optax.GradientTransformation``; the zero is an argument of the
compiled program)::

    def apply(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(lambda zero, *args: canonical(apply, zero)(*args))
    params, opt_state = step(np.uint32(0), grads, opt_state, params)

Why plain XLA is not reproducible: XLA contracts ``a * b + c`` into a fused multiply-add
on hardware that has one (AVX2, AVX-512, GPUs) and not elsewhere; its ``exp``, ``log``,
``rsqrt``... are its own approximations and differ between instruction sets; XLA CPU
flushes subnormal results to zero and GPUs do not; the order of a reduction's additions
is the backend's choice; by default XLA keeps some bfloat16 results in float32
(``xla_allow_excess_precision``); and NaN payloads depend on the hardware.

Definition ``zkdv-jax-canonical-v1``
--------------------------------
*Fence.* Every floating-point value that an operation produces (and every input and
constant) passes through ``fence(x)``: its bits are OR-ed with ``zero``, a uint32 0 that
is a *runtime* input of the program, so XLA cannot see through it and cannot fuse the
operations on either side (every operation is rounded on its own); then a value whose
magnitude is at most the format's smallest normal number becomes a zero of the same
sign. XLA CPU flushes subnormal results to zero and GPUs do not; flushing both agrees.
The smallest normal itself is flushed too: flush-to-zero hardware detects tininess after
rounding and returns zero for a few results that a subnormal-capable one rounds up to
the smallest normal. Operations that only move, select or negate values need no fence
(their operands are fenced); conversions do.

*NaN.* Every NaN in a result, and in a value reinterpreted as bits
(``bitcast_convert_type``), is the positive quiet NaN (``0x7FC00000`` for float32). A
NaN's payload and sign depend on the hardware, but a NaN operand always gives a NaN
and compares the same, so the payload is fixed only where it becomes visible.

*Exactly rounded operations.* ``add``, ``sub`` and ``mul`` of float32 and float64 are
IEEE-754 operations (round to nearest even). ``div`` and ``sqrt`` of float32, and every
arithmetic operation of float16 and bfloat16, are computed in float64 and rounded once to
the result type: float64 has more than twice the precision plus two bits, so the result
is the correctly rounded one (XLA's float32 division and square root on GPUs need not
be). ``rsqrt(x)`` is ``1 / sqrt(x)`` evaluated in float64 and rounded once.

*Exact operations*, evaluated as XLA does: ``neg``, ``abs``, ``sign``, ``floor``,
``ceil``, ``round``, ``copy``, comparisons, ``select_n``, ``is_finite``, ``nextafter``,
``convert_element_type``, ``reduce_precision``, integer and bitwise operations, and data
movement (broadcast, reshape, transpose, slice, concatenate, pad, gather...). ``max``
and ``min`` (and ``clamp``) return NaN if either operand is NaN, and on equal operands
``max(+0, -0) = +0``, ``min(+0, -0) = -0``. ``reduce_max`` and ``reduce_min`` follow the
same order (``-0 < +0``; NaN wins).

*Powers.* ``integer_pow(x, n)``, ``square``, ``pow`` with an integer exponent and ``pow``
with a literal integer-valued float exponent: binary powering (``x``, ``x^2``, ``x^4``...,
multiplied in from the lowest exponent bit up; a runtime integer exponent scans all the
bits of its type), each product fenced, in float64 for float32 and narrower, rounded
once; a negative exponent takes ``1 / x^|n|`` before rounding. ``pow`` with a literal
exponent of 0.5 or -0.5 is ``sqrt(x)`` or ``1 / sqrt(x)`` in float64, rounded once (of
``|x|`` for ``x = -0`` and ``-inf``, as C99's ``pow`` has it). Any other ``pow(x, y)`` is
``exp(y * log|x|)`` in float64, accurate to about ``(1 + |y log x|)`` float64 ulps, with
C99's special cases (``pow(x, 0) = 1``, ``pow(1, y) = 1``, ``pow(-1, +-inf) = 1``, a
negative base with an odd integer exponent negates, with a non-integer one gives NaN).

*Transcendentals* (``exp``, ``exp2``, ``log``, ``log1p``, ``expm1``, ``sin``, ``cos``,
``tan``, ``tanh``, ``logistic``, ``sinh``, ``cosh``): computed by the float64 formulas
in this module (Cody-Waite range reduction with fdlibm's split constants, Taylor
polynomials with the float64 coefficients nearest to ``1/k!`` and ``1/(2k+1)``, evaluated
by Horner's rule), every operation fenced, rounded once to the result type. Accurate to
a few float64 ulps (about 1e-15 relative); ``sin``, ``cos`` and ``tan`` are accurate for
``|x| < 2^20 * pi/2`` and merely deterministic beyond.

*Sums.* ``reduce_sum`` of floats is exact-then-rounded and independent of the order of
the additions. With ``n`` the number of terms, ``L = ceil(log2 n)`` and ``M`` the largest
finite magnitude, the terms (in float64) are split into levels ``k = 0, 1, ...`` with
quanta ``q_k = 2^(exponent(M) + 1 + L - 52 + k (L - 52))`` (exponents clipped to
[-1000, 1000]): level ``k`` takes from each term what is left of it rounded to a
multiple of ``q_k`` (``round_half_even(r / q_k) * q_k``) and leaves the remainder to
the next. A level's multiples stay below ``2^(52 - L) q_k``, so their sum is exact in
float64 in any order. The number of levels is ``ceil((L + p + 2) / (52 - L))`` for a
``p``-bit result, which bounds the discarded remainders by ``2^-(p+2) M``; the level sums
are added from level 0 down and rounded to the result type. Infinite and NaN terms are
summed apart (any order gives the same inf or NaN) and added last.

*Cumulative operations* (``cumsum``, ``cumprod``, ``cummax``, ``cummin``) run along the
axis one element after the other (from the last one with ``reverse``), each step an
operation above.

*Not canonical*: matrix products, convolutions, product reductions, ``cumlogsumexp``
of floats, sorting, scatters, float remainders and every primitive without a rule here
raise :class:`NotCanonical`, so a caller can fall back to the ordinary path. Control
flow (``jit``, ``cond``, ``while``, ``scan``, ``custom_jvp_call``, ``custom_vjp_call``,
``checkpoint``) is evaluated with these rules inside.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from zkdv.errors import ZKDVError
from zkdv.probes import CANONICAL_NAN

__all__ = ["CANONICAL_VERSION", "NotCanonical", "canonical", "check"]

#: The name of the rules in this module's docstring; recorded beside canonical results.
CANONICAL_VERSION = "zkdv-jax-canonical-v1"


class NotCanonical(ZKDVError):  # noqa: N818 - a signal to fall back, not a failure
    """The function uses a primitive (or a dtype) that has no canonical rule.

    The message names the primitive, so the caller can report why it fell back to the
    ordinary, non-reproducible evaluation.
    """


def canonical(function: Callable[..., Any], zero: Any) -> Callable[..., Any]:
    """Wrap ``function`` so that it is evaluated by the ``zkdv-jax-canonical-v1`` rules.

    Args:
        function: a JAX-traceable function of pytrees of arrays, e.g. an
            ``optax.GradientTransformation``'s ``update``.
        zero: a uint32 scalar that is 0 when the program runs. Pass a runtime value (a
            ``jax.jit`` argument, a program input): a constant is folded by XLA, and the
            fences it builds then no longer keep XLA from fusing multiply-adds.

    Returns:
        A function with the same signature and the same pytree of outputs. Tracing it
        raises :class:`NotCanonical` when ``function`` uses a primitive without a rule.

    Raises:
        ValueError: ``zero`` is not a uint32 scalar, or (when called) it is a constant
            of a traced program.
    """
    dtype = getattr(zero, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.uint32 or np.shape(zero) != ():
        raise ValueError(
            f"zero must be a uint32 scalar that is 0 at run time, got {zero!r} "
            f"(dtype {dtype}, shape {np.shape(zero)})"
        )

    @functools.wraps(function)
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))
        if not isinstance(zero, jax.core.Tracer) and any(
            isinstance(leaf, jax.core.Tracer) for leaf in leaves
        ):
            # XLA would fold `bits | 0` away, and with it every fence.
            raise ValueError(
                "zero is a constant of the traced program that calls the canonical "
                "function; pass it in as an argument of that program (of jax.jit)"
            )

        def flat(*values: Any) -> Any:
            positional, named = jax.tree.unflatten(tree, values)
            return function(*positional, **named)

        # Traced with the caller's x64 setting: that is the function's meaning.
        closed, shapes = jax.make_jaxpr(flat, return_shape=True)(*leaves)
        # Evaluated with x64 on: the rules compute in float64 and build uint64 fences.
        # Every value keeps the dtype of its jaxpr variable, so the outputs are unchanged.
        with jax.enable_x64(True):
            evaluator = _Evaluator(zero)
            inputs = [
                evaluator.fence(jnp.asarray(leaf, dtype=var.aval.dtype))
                for leaf, var in zip(leaves, closed.jaxpr.invars, strict=True)
            ]
            outputs = [evaluator.seal(y) for y in evaluator.run_closed(closed, inputs)]
        return jax.tree.unflatten(jax.tree.structure(shapes), outputs)

    return evaluate


def check(function: Callable[..., Any], *example_args: Any) -> str | None:
    """Whether :func:`canonical` can evaluate ``function`` on arguments like these.

    Traces abstractly (nothing is computed).

    Returns:
        None when it can, else the reason (the :class:`NotCanonical` message).
    """
    try:
        jax.eval_shape(
            lambda zero, *args: canonical(function, zero)(*args), np.uint32(0), *example_args
        )
    except NotCanonical as error:
        return str(error)
    return None


# --- Float formats --------------------------------------------------------------------


class _Format(NamedTuple):
    bits: np.dtype[Any]  # the unsigned integer type of the same width
    precision: int  # significand bits, the implicit one included
    sign: int
    magnitude: int  # all bits but the sign
    exponent: int  # the exponent field; a larger magnitude is a NaN
    min_normal: int
    nan: int


_FORMATS: dict[np.dtype[Any], _Format] = {
    np.dtype(jnp.float64): _Format(
        np.dtype(np.uint64), 53, 1 << 63, (1 << 63) - 1, 0x7FF << 52, 1 << 52, 0x7FF8 << 48
    ),
    np.dtype(jnp.float32): _Format(
        np.dtype(np.uint32), 24, 1 << 31, (1 << 31) - 1, 0x7F800000, 1 << 23, int(CANONICAL_NAN)
    ),
    np.dtype(jnp.float16): _Format(
        np.dtype(np.uint16), 11, 1 << 15, (1 << 15) - 1, 0x7C00, 1 << 10, 0x7E00
    ),
    np.dtype(jnp.bfloat16): _Format(
        np.dtype(np.uint16), 8, 1 << 15, (1 << 15) - 1, 0x7F80, 1 << 7, 0x7FC0
    ),
}

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _format(dtype: Any) -> _Format:
    fmt = _FORMATS.get(np.dtype(dtype))
    if fmt is None:
        raise NotCanonical(f"{CANONICAL_VERSION} has no rules for {np.dtype(dtype).name} values")
    return fmt


# --- Constants of the float64 formulas ------------------------------------------------


def _word(high: int, low: int) -> float:
    """The float64 with these two 32-bit halves (how fdlibm writes its constants)."""
    value: float = struct.unpack(">d", struct.pack(">II", high, low))[0]
    return value


def _nearest(numerator: int, denominator: int) -> float:
    return float(Fraction(numerator, denominator))  # correctly rounded, unlike 1.0 / n


# ln 2 split so that n * _LN2_HI is exact for |n| < 2^11 (fdlibm e_exp.c, e_log.c).
_LN2_HI = _word(0x3FE62E42, 0xFEE00000)
_LN2_LO = _word(0x3DEA39EF, 0x35793C76)
_INV_LN2 = _word(0x3FF71547, 0x652B82FE)
_SQRT2 = _word(0x3FF6A09E, 0x667F3BCD)
# pi/2 in 33-bit pieces and their tails (fdlibm e_rem_pio2.c): n * _PIO2_k is exact for
# |n| < 2^20, and three steps leave an error far below one float64 ulp of the result.
_INV_PIO2 = _word(0x3FE45F30, 0x6DC9C883)
_PIO2 = (
    (_word(0x3FF921FB, 0x54400000), _word(0x3DD0B461, 0x1A626331)),
    (_word(0x3DD0B461, 0x1A600000), _word(0x3BA3198A, 0x2E037073)),
    (_word(0x3BA3198A, 0x2E000000), _word(0x397B839A, 0x252049C1)),
)

# Taylor coefficients, highest degree first (Horner). For |r| <= ln2/2, the terms left
# out of exp and expm1 are below 1e-18 relative; for |r| <= pi/4, those of sin and cos
# below 1e-19; for |s| <= 3 - 2 sqrt2, those of atanh below 1e-18.
_EXP = tuple(_nearest(1, math.factorial(k)) for k in range(13, -1, -1))
_EXPM1 = tuple(_nearest(1, math.factorial(k + 1)) for k in range(13, -1, -1))  # (e^r-1)/r
_SIN = tuple(_nearest((-1) ** k, math.factorial(2 * k + 1)) for k in range(8, -1, -1))
_COS = tuple(_nearest((-1) ** k, math.factorial(2 * k)) for k in range(9, -1, -1))
_ATANH = tuple(_nearest(1, 2 * k + 1) for k in range(11, -1, -1))  # atanh(s)/s in s^2

_EXPM1_SERIES_BOUND = 0.34657359027997264  # ln2 / 2, rounded down
_HYPERBOLIC_LARGE = 22.0  # above it e^-|x| is below float64's resolution of e^|x|


# --- The evaluator --------------------------------------------------------------------

_Rule = Callable[["_Evaluator", Any, list[Any]], list[Any]]


class _Evaluator:
    """Fenced arithmetic and the jaxpr interpreter; built with x64 enabled."""

    def __init__(self, zero: Any) -> None:
        zero = jnp.asarray(zero, dtype=jnp.uint32)
        # Converted once, here, outside any control flow: a value first made inside a
        # loop body could not be reused after the loop.
        self.zeros = {
            np.dtype(np.uint16): lax.convert_element_type(zero, jnp.uint16),
            np.dtype(np.uint32): zero,
            np.dtype(np.uint64): lax.convert_element_type(zero, jnp.uint64),
        }

    # Fences and exactly rounded arithmetic ------------------------------------------

    def fence(self, x: Any) -> Any:
        """``x`` rounded on its own, with a magnitude up to the smallest normal flushed."""
        if not _is_float(x.dtype):
            return x
        fmt = _format(x.dtype)
        # lax, not jnp: this follows every operation, and jnp.where would add a call.
        bits = lax.bitcast_convert_type(x, fmt.bits)
        bits = lax.bitwise_or(bits, lax.broadcast(self.zeros[fmt.bits], x.shape))
        magnitude = lax.bitwise_and(bits, lax.full(x.shape, fmt.magnitude, fmt.bits))
        flushed = lax.bitwise_and(bits, lax.full(x.shape, fmt.sign, fmt.bits))
        tiny = lax.le(magnitude, lax.full(x.shape, fmt.min_normal, fmt.bits))
        return lax.bitcast_convert_type(lax.select(tiny, flushed, bits), x.dtype)

    @staticmethod
    def seal(x: Any) -> Any:
        """``x`` with every NaN made the canonical one, where its bits become visible.

        A NaN's payload and sign depend on the hardware, but any NaN operand gives a NaN
        and compares the same, so only results and bitcasts need this.
        """
        if not _is_float(x.dtype):
            return x
        fmt = _format(x.dtype)
        bits = lax.bitcast_convert_type(x, fmt.bits)
        magnitude = lax.bitwise_and(bits, lax.full(x.shape, fmt.magnitude, fmt.bits))
        nan = lax.gt(magnitude, lax.full(x.shape, fmt.exponent, fmt.bits))
        bits = lax.select(nan, lax.full(x.shape, fmt.nan, fmt.bits), bits)
        return lax.bitcast_convert_type(bits, x.dtype)

    def round(self, x: Any, dtype: Any) -> Any:
        """A (fenced) float64 result rounded once to ``dtype`` and fenced."""
        if np.dtype(dtype) == _F64:
            return x
        return self.fence(lax.convert_element_type(x, dtype))

    @staticmethod
    def wide(x: Any) -> Any:
        return lax.convert_element_type(x, jnp.float64)

    def add(self, a: Any, b: Any) -> Any:
        return self.fence(jnp.add(a, b))

    def sub(self, a: Any, b: Any) -> Any:
        return self.fence(jnp.subtract(a, b))

    def mul(self, a: Any, b: Any) -> Any:
        return self.fence(jnp.multiply(a, b))

    def div(self, a: Any, b: Any) -> Any:
        return self.fence(jnp.divide(a, b))

    def horner(self, x: Any, coefficients: Sequence[float]) -> Any:
        def step(result: Any, c: Any) -> tuple[Any, None]:
            return self.add(self.mul(result, x), c), None

        # A loop rather than unrolled steps keeps the program small.
        first = jnp.full_like(x, coefficients[0])
        result, _ = lax.scan(step, first, np.asarray(coefficients[1:], np.float64))
        return result

    # Float64 formulas (inputs and results float64, every operation fenced) -----------

    def pow2(self, k: Any) -> Any:
        """``2^k`` for integer ``k`` in [-1022, 1023], built from its bits."""
        biased = lax.convert_element_type(k + 1023, jnp.int64)
        return lax.bitcast_convert_type(lax.shift_left(biased, np.int64(52)), jnp.float64)

    def exp_reduced(self, n: Any, r: Any) -> Any:
        """``2^n * e^r`` for integral ``n`` in [-1076, 1024] and ``|r| <= ln2/2``."""
        k = lax.convert_element_type(n, jnp.int64)
        half = lax.shift_right_arithmetic(k, np.int64(1))
        # Two factors keep each power of two normal; the result may still overflow to
        # inf or underflow (and be flushed) in the second product.
        return self.mul(self.mul(self.horner(r, _EXP), self.pow2(half)), self.pow2(k - half))

    def exp(self, x: Any) -> Any:
        clipped = jnp.clip(x, -746.0, 710.0)  # beyond: 0 and inf
        n = lax.round(self.mul(clipped, _INV_LN2), lax.RoundingMethod.TO_NEAREST_EVEN)
        r = self.sub(self.sub(clipped, self.mul(n, _LN2_HI)), self.mul(n, _LN2_LO))
        return jnp.where(jnp.isnan(x), x, self.exp_reduced(n, r))

    def exp2(self, x: Any) -> Any:
        clipped = jnp.clip(x, -1076.0, 1025.0)
        n = lax.round(clipped, lax.RoundingMethod.TO_NEAREST_EVEN)
        r = self.mul(self.sub(clipped, n), math.log(2.0))  # x - n is exact
        return jnp.where(jnp.isnan(x), x, self.exp_reduced(n, r))

    def expm1(self, x: Any) -> Any:
        small = jnp.abs(x) < _EXPM1_SERIES_BOUND
        near = jnp.where(small, x, 0.0)
        series = self.mul(near, self.horner(near, _EXPM1))
        # Away from 0, e^x - 1 loses at most a bit or two: e^x >= 0.7 there.
        return jnp.where(small, series, self.sub(self.exp(x), 1.0))

    def log(self, x: Any) -> Any:
        # x = m * 2^e with m in [sqrt(2)/2, sqrt(2)); log m = 2 atanh(s), s = (m-1)/(m+1).
        bits = lax.bitcast_convert_type(x, jnp.uint64)
        e = lax.convert_element_type(bits >> np.uint64(52), jnp.int64) - 1023
        m = lax.bitcast_convert_type(
            (bits & np.uint64((1 << 52) - 1)) | np.uint64(1023 << 52), jnp.float64
        )
        big = m > _SQRT2
        m = jnp.where(big, self.mul(m, 0.5), m)
        e = lax.convert_element_type(jnp.where(big, e + 1, e), jnp.float64)
        f = self.sub(m, 1.0)  # exact
        s = self.div(f, self.add(f, 2.0))
        log_m = self.mul(self.mul(s, 2.0), self.horner(self.mul(s, s), _ATANH))
        result = self.add(self.mul(e, _LN2_HI), self.add(self.mul(e, _LN2_LO), log_m))
        result = jnp.where(x == 0.0, -jnp.inf, result)
        result = jnp.where(x == jnp.inf, jnp.inf, result)
        return jnp.where(x < 0.0, jnp.nan, jnp.where(jnp.isnan(x), x, result))

    def log1p(self, x: Any) -> Any:
        # Kahan: log(u) * x / (u - 1) with u = 1 + x rounded corrects u's rounding.
        u = self.add(x, 1.0)
        d = self.sub(u, 1.0)
        result = self.mul(self.log(u), self.div(x, jnp.where(d == 0.0, 1.0, d)))
        result = jnp.where(d == 0.0, x, result)  # |x| below half an ulp of 1
        return jnp.where(x == jnp.inf, x, result)

    def reduce_pio2(self, x: Any) -> tuple[Any, Any]:
        """``(r, q)``: ``x = r + (n * pi/2)``, ``|r| <= pi/4``, ``q = n mod 4`` (float64)."""
        n = lax.round(self.mul(x, _INV_PIO2), lax.RoundingMethod.TO_NEAREST_EVEN)
        (head, _), *refinements = _PIO2
        r = self.sub(x, self.mul(n, head))
        w = jnp.zeros_like(x)
        for piece, tail in refinements:
            t = r
            w = self.mul(n, piece)
            r = self.sub(t, w)
            w = self.sub(self.mul(n, tail), self.sub(self.sub(t, r), w))
        q = self.sub(n, self.mul(jnp.floor(self.mul(n, 0.25)), 4.0))
        return self.sub(r, w), q

    def sin_cos_reduced(self, r: Any) -> tuple[Any, Any]:
        z = self.mul(r, r)
        return self.mul(r, self.horner(z, _SIN)), self.horner(z, _COS)

    def sin(self, x: Any) -> Any:
        r, q = self.reduce_pio2(x)
        s, c = self.sin_cos_reduced(r)
        return _quadrant(q, s, c, -s, -c)

    def cos(self, x: Any) -> Any:
        r, q = self.reduce_pio2(x)
        s, c = self.sin_cos_reduced(r)
        return _quadrant(q, c, -s, -c, s)

    def tan(self, x: Any) -> Any:
        r, q = self.reduce_pio2(x)
        s, c = self.sin_cos_reduced(r)
        odd = (q == 1.0) | (q == 3.0)
        return jnp.where(odd, -self.div(c, s), self.div(s, c))

    def tanh(self, x: Any) -> Any:
        # tanh|x| = -e / (e + 2) with e = expm1(-2|x|): no overflow, no cancellation.
        e = self.expm1(self.mul(jnp.abs(x), -2.0))
        return jnp.copysign(self.div(-e, self.add(e, 2.0)), x)

    def logistic(self, x: Any) -> Any:
        return self.div(1.0, self.add(self.exp(-x), 1.0))

    def exp_large(self, a: Any) -> Any:
        """``e^a / 2`` for ``a >= 0`` without overflowing where the result does not."""
        w = self.exp(self.mul(a, 0.5))
        return self.mul(self.mul(w, 0.5), w)

    def sinh(self, x: Any) -> Any:
        a = jnp.abs(x)
        e = self.expm1(jnp.minimum(a, _HYPERBOLIC_LARGE))
        # sinh a = (E + E / (E + 1)) / 2 with E = e^a - 1 (fdlibm e_sinh.c).
        small = self.mul(self.add(e, self.div(e, self.add(e, 1.0))), 0.5)
        return jnp.copysign(jnp.where(a < _HYPERBOLIC_LARGE, small, self.exp_large(a)), x)

    def cosh(self, x: Any) -> Any:
        a = jnp.abs(x)
        e = self.exp(jnp.minimum(a, _HYPERBOLIC_LARGE))
        small = self.mul(self.add(e, self.div(1.0, e)), 0.5)
        return jnp.where(a < _HYPERBOLIC_LARGE, small, self.exp_large(a))

    def power_static(self, x: Any, n: int) -> Any:
        """``x^n`` by binary powering for a Python integer ``n``."""
        result = None
        base = x
        remaining = abs(n)
        while remaining:
            if remaining & 1:
                result = base if result is None else self.mul(result, base)
            remaining >>= 1
            if remaining:
                base = self.mul(base, base)
        if result is None:
            return jnp.ones_like(x)
        return self.div(1.0, result) if n < 0 else result

    def power_dynamic(self, x: Any, n: Any) -> Any:
        """``x^n`` by binary powering over every bit of the integer array ``n``."""
        width = np.dtype(n.dtype).itemsize * 8
        unsigned = np.dtype(f"uint{width}")
        negative = n < 0
        bits = lax.bitcast_convert_type(n, unsigned)
        # Two's complement magnitude, right for the most negative value too.
        magnitude = jnp.where(negative, ~bits + unsigned.type(1), bits)

        def multiply_in(i: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            result, base = carry
            bit = (magnitude >> lax.convert_element_type(i, unsigned)) & unsigned.type(1)
            return jnp.where(bit == 1, self.mul(result, base), result), self.mul(base, base)

        # A loop rather than `width` unrolled steps keeps the program small.
        result, _ = lax.fori_loop(0, width, multiply_in, (jnp.ones_like(x), x))
        return jnp.where(negative, self.div(1.0, result), result)

    def power(self, x: Any, y: Any) -> Any:
        """``x^y`` for float64 ``x`` and ``y``: ``exp(y log|x|)`` and C99's cases."""
        integral = jnp.floor(y) == y  # true for +-inf: even
        odd = integral & (self.mul(jnp.floor(self.mul(y, 0.5)), 2.0) != y)
        a = jnp.abs(x)
        result = self.exp(self.mul(y, self.log(a)))
        result = jnp.where(jnp.signbit(x) & odd, -result, result)
        result = jnp.where((x < 0.0) & jnp.isfinite(x) & ~integral, jnp.nan, result)
        result = jnp.where((a == 1.0) & jnp.isinf(y), 1.0, result)
        return jnp.where((y == 0.0) | (x == 1.0), 1.0, result)

    def maximum(self, a: Any, b: Any, largest: bool) -> Any:
        a, b = jnp.broadcast_arrays(a, b)
        fmt = _format(a.dtype)
        a_bits = lax.bitcast_convert_type(a, fmt.bits)
        b_bits = lax.bitcast_convert_type(b, fmt.bits)
        # Equal operands differ at most in the sign of a zero.
        tie = (a_bits & b_bits) if largest else (a_bits | b_bits)
        pick = jnp.where(a > b, a, b) if largest else jnp.where(a < b, a, b)
        result = jnp.where(a == b, lax.bitcast_convert_type(tie, a.dtype), pick)
        return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.nan, result)

    def extreme(self, x: Any, axes: tuple[int, ...], largest: bool) -> Any:
        """``reduce_max``/``reduce_min`` in the total order ``-0 < +0``; NaN wins."""
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        if math.prod(x.shape[i] for i in axes) == 0:
            return jnp.full(shape, -jnp.inf if largest else jnp.inf, x.dtype)
        fmt = _format(x.dtype)
        sign = fmt.bits.type(fmt.sign)
        bits = lax.bitcast_convert_type(x, fmt.bits)
        # An unsigned key in the order of the values: negatives reversed below positives.
        key = jnp.where(bits & sign, ~bits, bits | sign)
        key = lax.reduce_max(key, axes) if largest else lax.reduce_min(key, axes)
        bits = jnp.where(key & sign, key & ~sign, ~key)
        result = lax.bitcast_convert_type(bits, x.dtype)
        has_nan = lax.reduce_or(jnp.isnan(x), axes)
        return jnp.where(has_nan, jnp.nan, result)

    def exact_sum(self, x: Any, axes: tuple[int, ...], dtype: Any) -> Any:
        """``reduce_sum`` by the order-independent levels described above."""
        n = math.prod(x.shape[i] for i in axes)
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        if n == 0:
            return jnp.zeros(shape, dtype)
        spread = max(n - 1, 0).bit_length()  # ceil(log2 n)
        if spread > 40:
            raise NotCanonical(f"reduce_sum of {n} terms is beyond {CANONICAL_VERSION}")
        levels = -(-(spread + _format(dtype).precision + 2) // (52 - spread))
        kept = [i for i in range(x.ndim) if i not in axes]
        wide = self.wide(x)
        finite = jnp.isfinite(wide)
        rest = jnp.where(finite, wide, 0.0)
        peak = lax.reduce_max(jnp.abs(rest), axes)
        top = lax.convert_element_type(
            lax.bitcast_convert_type(peak, jnp.uint64) >> np.uint64(52), jnp.int64
        )
        parts = []
        for level in range(levels):
            # Level k's quantum is q * 2^(k (L - 52)): the remainders of the level above
            # are below half its quantum, so they stay below 2^(52 - L) quanta.
            exponent = top - 1023 + 1 + spread - 52 + level * (spread - 52)
            exponent = jnp.clip(exponent, -1000, 1000)
            q = lax.broadcast_in_dim(self.pow2(exponent), x.shape, kept)
            inverse = lax.broadcast_in_dim(self.pow2(-exponent), x.shape, kept)
            # Products by powers of two, rounding to an integer and the remainder are
            # all exact: nothing to fence but a remainder's possible float64 subnormal.
            multiples = lax.round(rest * inverse, lax.RoundingMethod.TO_NEAREST_EVEN) * q
            rest = self.fence(rest - multiples)
            parts.append(multiples)
        parts.append(jnp.where(finite, 0.0, wide))  # inf, -inf, NaN: any order agrees
        # One reduction for all levels; each sum is exact, so in any order.
        sums = lax.reduce_sum(jnp.stack(parts), tuple(i + 1 for i in axes))
        total = sums[0]
        for level_sum in sums[1:]:
            total = self.add(total, level_sum)
        return self.round(total, dtype)

    # The interpreter ---------------------------------------------------------------

    def run_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        consts = [self.fence(jnp.asarray(c)) for c in closed.consts]
        return self.run(closed.jaxpr, consts, args)

    def run_any(self, jaxpr: Any, args: Sequence[Any]) -> list[Any]:
        if isinstance(jaxpr, core.ClosedJaxpr):
            return self.run_closed(jaxpr, args)
        return self.run(jaxpr, [], args)

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            if isinstance(var, core.Literal):
                aval: Any = var.aval
                return _fence_constant(np.asarray(var.val, dtype=aval.dtype))
            return env[var]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            outputs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, value in zip(eqn.outvars, outputs, strict=True):
                if not isinstance(var, core.DropVar):
                    env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, args: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        dtypes = [getattr(v.aval, "dtype", None) for v in (*eqn.invars, *eqn.outvars)]
        if any(d is None or jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
            raise NotCanonical(
                f"{CANONICAL_VERSION} has no rule for the JAX primitive '{name}' on "
                f"{', '.join(str(d) for d in dtypes)}: only real and integer arrays are"
                " canonical"
            )
        nested = any(True for _ in core.jaxprs_in_params(eqn.params))
        if name in _EXACT or not (nested or any(_is_float(d) for d in dtypes)):
            # Exact on every backend: data movement, comparisons, integer arithmetic. Their
            # float results are (flushed) operands, except for conversions.
            if name == "bitcast_convert_type":
                args = [self.seal(a) for a in args]
            if name in _CONVERSIONS:
                return [self.fence(y) for y in _bind(eqn, args)]
            return _bind(eqn, args)
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, eqn, args)
        reason = _REASONS.get(name, "no canonical rule is defined for it")
        raise NotCanonical(
            f"{CANONICAL_VERSION} cannot evaluate the JAX primitive '{name}' on floats: "
            f"{reason}. Run this computation outside the canonical region."
        )


def _fence_constant(value: np.ndarray[Any, Any]) -> Any:
    """A literal fenced and sealed here: a constant is not the result of an operation."""
    fmt = _FORMATS.get(value.dtype)
    if fmt is not None:
        bits = value.view(fmt.bits).copy()
        magnitude = bits & fmt.bits.type(fmt.magnitude)
        bits[magnitude <= fmt.min_normal] &= fmt.bits.type(fmt.sign)
        bits[magnitude > fmt.exponent] = fmt.nan
        value = bits.view(value.dtype)
    return jnp.asarray(value)


def _quadrant(q: Any, *values: Any) -> Any:
    # Nested selects, not jnp.select: that one builds an argmax whose index type follows
    # the x64 setting, which differs between this tracing and the caller's lowering.
    result = values[3]
    for k in (2.0, 1.0, 0.0):
        result = jnp.where(q == k, values[int(k)], result)
    return result


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    result = eqn.primitive.bind(*args, **eqn.params)
    return list(result) if eqn.primitive.multiple_results else [result]


def _out_dtype(eqn: Any) -> Any:
    return eqn.outvars[0].aval.dtype


# --- Rules ----------------------------------------------------------------------------


def _ieee(ev: _Evaluator, op: Callable[..., Any], args: Sequence[Any], native_f32: bool) -> Any:
    """An IEEE operation: native where it is correctly rounded, else in float64."""
    dtype = np.dtype(args[0].dtype)
    if dtype == _F64 or (dtype == _F32 and native_f32):
        return ev.fence(op(*args))
    # One float64 operation on exactly converted operands, rounded at once: nothing to
    # fuse it with, and no float64 subnormal can arise from narrower operands.
    return ev.round(op(*[ev.wide(a) for a in args]), dtype)


def _arithmetic(native_f32: bool) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        op = functools.partial(eqn.primitive.bind, **eqn.params)
        return [_ieee(ev, op, args, native_f32)]

    return rule


def _cumulative(combine: Callable[[_Evaluator, Any, Any], Any]) -> _Rule:
    """``cumsum`` and friends, one element after the other along the axis."""

    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        axis, reverse = eqn.params["axis"], eqn.params["reverse"]
        x = jnp.moveaxis(args[0], axis, 0)
        if x.shape[0] <= 1:
            return [args[0]]

        def step(carry: Any, row: Any) -> tuple[Any, Any]:
            carry = combine(ev, carry, row)
            return carry, carry

        if reverse:
            _, ys = lax.scan(step, x[-1], x[:-1], reverse=True)
            result = jnp.concatenate([ys, x[-1:]])
        else:
            _, ys = lax.scan(step, x[0], x[1:])
            result = jnp.concatenate([x[:1], ys])
        return [jnp.moveaxis(result, 0, axis)]

    return rule


def _float64_formula(formula: Callable[[_Evaluator, Any], Any]) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        return [ev.round(formula(ev, ev.wide(args[0])), _out_dtype(eqn))]

    return rule


def _rsqrt(ev: _Evaluator, x: Any) -> Any:
    return ev.div(1.0, ev.fence(jnp.sqrt(x)))


def _integer_pow(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.round(ev.power_static(ev.wide(args[0]), eqn.params["y"]), _out_dtype(eqn))]


def _square(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.round(ev.power_static(ev.wide(args[0]), 2), _out_dtype(eqn))]


def _pow(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    x, y = args
    dtype = _out_dtype(eqn)
    exponent = eqn.invars[1]
    if not _is_float(y.dtype):
        x, y = jnp.broadcast_arrays(ev.wide(x), y)
        return [ev.round(ev.power_dynamic(x, y), dtype)]
    if isinstance(exponent, core.Literal) and np.ndim(exponent.val) == 0:
        value = float(exponent.val)
        if value.is_integer() and abs(value) < 2**31:  # x ** 2.0 as written in code
            return [ev.round(ev.power_static(ev.wide(x), int(value)), dtype)]
        if abs(value) == 0.5:  # x ** 0.5, x ** -0.5: correctly rounded square roots
            wide = ev.wide(x)
            # pow(-0, y) = +0 and pow(-inf, y) = +inf for y = 0.5 (C99), unlike sqrt.
            wide = jnp.where((wide == 0.0) | (wide == -jnp.inf), jnp.abs(wide), wide)
            root = ev.fence(jnp.sqrt(wide))
            return [ev.round(root if value > 0 else ev.div(1.0, root), dtype)]
    x, y = jnp.broadcast_arrays(ev.wide(x), ev.wide(y))
    return [ev.round(ev.power(x, y), dtype)]


def _maximum(largest: bool) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        a, b = args
        return [ev.maximum(a, b, largest=largest)]

    return rule


def _clamp(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    low, x, high = args
    return [ev.maximum(ev.maximum(x, low, largest=True), high, largest=False)]


def _reduce_extreme(largest: bool) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        return [ev.extreme(args[0], tuple(eqn.params["axes"]), largest)]

    return rule


def _reduce_sum(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.exact_sum(args[0], tuple(eqn.params["axes"]), _out_dtype(eqn))]


def _inline(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return ev.run_any(eqn.params[key], args)
    raise NotCanonical(f"{CANONICAL_VERSION} found no jaxpr in '{eqn.primitive.name}'")


def _cond(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    index, *operands = args

    def branch(closed: Any) -> Callable[..., tuple[Any, ...]]:
        return lambda *xs: tuple(ev.run_closed(closed, xs))

    return list(lax.switch(index, [branch(b) for b in eqn.params["branches"]], *operands))


def _while(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    p = eqn.params
    split = p["cond_nconsts"] + p["body_nconsts"]
    cond_consts, body_consts = args[: p["cond_nconsts"]], args[p["cond_nconsts"] : split]

    def cond(carry: Any) -> Any:
        return ev.run_closed(p["cond_jaxpr"], [*cond_consts, *carry])[0]

    def body(carry: Any) -> tuple[Any, ...]:
        return tuple(ev.run_closed(p["body_jaxpr"], [*body_consts, *carry]))

    return list(lax.while_loop(cond, body, tuple(args[split:])))


def _scan(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    p = eqn.params
    consts = args[: p["num_consts"]]
    init = tuple(args[p["num_consts"] : p["num_consts"] + p["num_carry"]])
    xs = tuple(args[p["num_consts"] + p["num_carry"] :])

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[Any, Any]:
        outputs = ev.run_closed(p["jaxpr"], [*consts, *carry, *x])
        return tuple(outputs[: p["num_carry"]]), tuple(outputs[p["num_carry"] :])

    carry, ys = lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


_RULES: dict[str, _Rule] = {
    "add": _arithmetic(native_f32=True),
    "add_any": _arithmetic(native_f32=True),
    "sub": _arithmetic(native_f32=True),
    "mul": _arithmetic(native_f32=True),
    "div": _arithmetic(native_f32=False),
    "sqrt": _arithmetic(native_f32=False),
    "rsqrt": _float64_formula(_rsqrt),
    "integer_pow": _integer_pow,
    "square": _square,
    "pow": _pow,
    "exp": _float64_formula(_Evaluator.exp),
    "exp2": _float64_formula(_Evaluator.exp2),
    "expm1": _float64_formula(_Evaluator.expm1),
    "log": _float64_formula(_Evaluator.log),
    "log1p": _float64_formula(_Evaluator.log1p),
    "sin": _float64_formula(_Evaluator.sin),
    "cos": _float64_formula(_Evaluator.cos),
    "tan": _float64_formula(_Evaluator.tan),
    "tanh": _float64_formula(_Evaluator.tanh),
    "logistic": _float64_formula(_Evaluator.logistic),
    "sinh": _float64_formula(_Evaluator.sinh),
    "cosh": _float64_formula(_Evaluator.cosh),
    "max": _maximum(largest=True),
    "min": _maximum(largest=False),
    "clamp": _clamp,
    "reduce_max": _reduce_extreme(largest=True),
    "reduce_min": _reduce_extreme(largest=False),
    "reduce_sum": _reduce_sum,
    "cumsum": _cumulative(lambda ev, a, b: _ieee(ev, lax.add, (a, b), native_f32=True)),
    "cumprod": _cumulative(lambda ev, a, b: _ieee(ev, lax.mul, (a, b), native_f32=True)),
    "cummax": _cumulative(lambda ev, a, b: ev.maximum(a, b, largest=True)),
    "cummin": _cumulative(lambda ev, a, b: ev.maximum(a, b, largest=False)),
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "core_call": _inline,
    "checkpoint": _inline,
    "remat": _inline,
    "remat2": _inline,
    "custom_jvp_call": _inline,
    "custom_vjp_call": _inline,
    "custom_vjp_call_jaxpr": _inline,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
}

# Exact operations on floats, evaluated as XLA does (then fenced).
_EXACT = frozenset(
    {
        "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "nextafter",
        "copy", "copy_p", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
        "convert_element_type", "bitcast_convert_type", "reduce_precision",
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
        "split", "stack", "unstack", "tile", "zeros_like", "iota", "argmax", "argmin",
        "stop_gradient", "optimization_barrier", "layout_constraint",
        "sharding_constraint", "device_put", "mesh_cast", "reshard",
    }
)  # fmt: skip

# Exact operations whose float results are new values, possibly subnormal.
_CONVERSIONS = frozenset(
    {"convert_element_type", "bitcast_convert_type", "reduce_precision", "nextafter", "iota"}
)

_ORDER = "its result depends on the backend's order of additions and use of fused multiply-adds"
_REASONS = {
    "dot_general": f"a matrix product or contraction; {_ORDER}",
    "conv_general_dilated": f"a convolution; {_ORDER}",
    "reduce_prod": "a product reduction's rounding depends on the backend's order",
    "cumlogsumexp": f"a cumulative log-sum-exp; {_ORDER}",
    "sort": "sorting floats has no canonical rule",
    "scatter": "a scatter's result with repeated indices depends on the backend",
    "scatter-add": f"a scatter-add; {_ORDER}",
    "scatter_add": f"a scatter-add; {_ORDER}",
    "rem": "XLA's float remainder is not exact on every backend",
    "reduce_window_sum": f"a windowed sum; {_ORDER}",
}
