"""Fenced arithmetic for ``zkdv-jax-canonical-v1`` (:mod:`zkdv.jax.canonical`).

The float formats the rules know, the float64 constants of the formulas (fdlibm's split
constants, correctly rounded Taylor coefficients), and :class:`_Arithmetic`: the fence,
the NaN seal, exactly rounded operations and the float64 formulas (transcendentals,
powers, order-independent sums) that the rules evaluate, every operation fenced.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv.errors import ZKDVError
from zkdv.probes import CANONICAL_NAN

#: The name of the rules in :mod:`zkdv.jax.canonical`'s docstring; recorded beside
#: canonical results.
CANONICAL_VERSION = "zkdv-jax-canonical-v1"


class NotCanonical(ZKDVError):  # noqa: N818 - a signal to fall back, not a failure
    """The function uses a primitive (or a dtype) that has no canonical rule.

    The message names the primitive, so the caller can report why it fell back to the
    ordinary, non-reproducible evaluation.
    """


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


class _Arithmetic:
    """Fenced arithmetic and the float64 formulas; built with x64 enabled."""

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

    def tied(self, x: Any, other: Any) -> Any:
        """``x`` broadcast against ``other`` (of its dtype), bit for bit, computed from
        every element of ``other``: no longer a broadcast that XLA can simplify."""
        fmt = _format(x.dtype)
        shape = np.broadcast_shapes(np.shape(x), np.shape(other))
        bits = lax.bitcast_convert_type(jnp.broadcast_to(x, shape), fmt.bits)
        theirs = lax.bitcast_convert_type(jnp.broadcast_to(other, shape), fmt.bits)
        nothing = lax.bitwise_and(theirs, lax.broadcast(self.zeros[fmt.bits], shape))
        return lax.bitcast_convert_type(lax.bitwise_or(bits, nothing), x.dtype)

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
        """``reduce_sum`` by the order-independent levels (:mod:`zkdv.jax.canonical`, *Sums*)."""
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


def _quadrant(q: Any, *values: Any) -> Any:
    # Nested selects, not jnp.select: that one builds an argmax whose index type follows
    # the x64 setting, which differs between this tracing and the caller's lowering.
    result = values[3]
    for k in (2.0, 1.0, 0.0):
        result = jnp.where(q == k, values[int(k)], result)
    return result
