"""Order-independent sums for ``zkdv-jax-canonical-v2`` (:mod:`zkdv.jax.canonical`, *Sums*).

Float32 (and narrower) sums are exact integer sums of the terms' bits, rounded once;
float64 sums are exact-then-rounded by float64 levels (only under x64).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv.jax._canonical_arithmetic import (
    _F32,
    _FRACTION32,
    _HIDDEN32,
    _INF32,
    _SIGN32,
    CANONICAL_VERSION,
    ISOLATED,
    NotCanonical,
    _Arithmetic,
    _u32,
)


def exact_sum64(ev: _Arithmetic, x: Any, axes: tuple[int, ...]) -> Any:
    """Float64 ``reduce_sum`` by order-independent levels (float64 values only)."""
    n = math.prod(x.shape[i] for i in axes)
    shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    if n == 0:
        return jnp.zeros(shape, x.dtype)
    spread = max(n - 1, 0).bit_length()  # ceil(log2 n)
    if spread > 40:
        raise NotCanonical(f"reduce_sum of {n} terms is beyond {CANONICAL_VERSION}")
    levels = -(-(spread + 53 + 2) // (52 - spread))
    kept = [i for i in range(x.ndim) if i not in axes]
    finite = jnp.isfinite(x)
    rest = jnp.where(finite, x, 0.0)
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
        q = lax.broadcast_in_dim(ev.pow2(exponent, x), x.shape, kept)
        inverse = lax.broadcast_in_dim(ev.pow2(-exponent, x), x.shape, kept)
        # Products by powers of two, rounding to an integer and the remainder are
        # all exact: nothing to fence but a remainder's possible float64 subnormal.
        multiples = lax.round(rest * inverse, lax.RoundingMethod.TO_NEAREST_EVEN) * q
        rest = ev.fence(rest - multiples)
        parts.append(multiples)
    parts.append(jnp.where(finite, 0.0, x))  # inf, -inf, NaN: any order agrees
    # One reduction for all levels; each sum is exact, so in any order.
    sums = lax.reduce_sum(jnp.stack(parts), tuple(i + 1 for i in axes))
    total = sums[0]
    for level_sum in sums[1:]:
        total = ev.add(total, level_sum)
    return total


# Float32 sums: the terms' bits as integers ----------------------------------------------
#
# Every finite float32 term is s * m * 2^(E - 150) with a 24-bit m and its exponent field
# E. With M the largest E among the terms, n the number of terms, L = ceil(log2 n) and
# S = L + 9, each term becomes the integer N = trunc(m * 2^(E - M + S)) in units of
# 2^(M - 150 - S): below 2^(33 + L), and off by less than one unit, so the n truncations
# together lose less than 2^L units, 2^-32 of the largest term. Each N is cut into 16-bit
# digits, and each digit position is summed, positive and negative terms apart, as
# unsigned 32-bit integers: 2^16 terms of 16 bits cannot overflow, so a sum over more
# terms first sums blocks of 2^16 and then each block sum's two halves. Integer sums are
# exact, so the backend's order of additions cannot matter. The digit sums are then
# carried into one signed integer and rounded once, to nearest even, to the result's
# precision (24 bits for float32, 11 for float16, 8 for bfloat16).

_DIGIT = 16
_BLOCK = 1 << 16


def exact_sum32(ev: _Arithmetic, x: Any, axes: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
    """The sum over ``axes`` of float32 ``x`` (fenced), exact and rounded once to ``dtype``."""
    kept = [i for i in range(x.ndim) if i not in axes]
    shape = tuple(x.shape[i] for i in kept)
    n = math.prod(x.shape[i] for i in axes)
    if n == 0:
        return jnp.zeros(shape, dtype)
    if n > 1 << 32:
        raise NotCanonical(f"reduce_sum of {n} terms is beyond {CANONICAL_VERSION}")
    terms = jnp.reshape(jnp.transpose(x, (*kept, *axes)), (*shape, n))
    finite = jnp.isfinite(terms)
    special = lax.reduce_sum(jnp.where(finite, 0.0, terms), (len(shape),))  # inf, NaN
    bits = jnp.where(finite, lax.bitcast_convert_type(terms, jnp.uint32), _u32(0))
    field = (bits >> _u32(23)) & _u32(0xFF)
    m = jnp.where(field > 0, (bits & _FRACTION32) | _HIDDEN32, _u32(0))
    negative = (bits >> _u32(31)) == _u32(1)
    top = lax.reduce_max(field, (len(shape),))  # M
    spread = max(n - 1, 0).bit_length()  # L
    guard = spread + 9  # S
    digits = -(-(33 + spread) // _DIGIT)
    shift = field.astype(jnp.int32) - top[..., None].astype(jnp.int32) + guard
    positive_words, negative_words = [], []
    for j in range(digits):
        t = _DIGIT * j - shift  # digit j of N is m's bits t .. t + 15
        right = jnp.clip(t, 0, 31).astype(jnp.uint32)
        left = jnp.clip(-t, 0, 31).astype(jnp.uint32)
        digit = jnp.where(t >= 0, m >> right, m << left) & _u32(0xFFFF)
        positive_words.append(jnp.where(negative, _u32(0), digit))
        negative_words.append(jnp.where(negative, digit, _u32(0)))
    plus = _digit_sums(jnp.stack(positive_words), n)
    minus = _digit_sums(jnp.stack(negative_words), n)
    unit = top.astype(jnp.int32) - 150 - guard
    if math.prod(shape) <= ISOLATED:
        total = ev.isolated(lambda p, q, u: _round_integer(p, q, u, dtype), plus, minus, unit)
    else:
        total = _round_integer(plus, minus, unit, dtype)
    result = jnp.where(jnp.isfinite(special) & (special == 0), total, special)
    return ev.round(result, dtype) if np.dtype(dtype) != _F32 else result


def _digit_sums(words: Any, n: int) -> list[list[Any]]:
    """Exact sums over the last axis of 16-bit digits ``(digits, ..., n)``: for each
    position ``j`` (of weight ``2^(16 j)``), uint32 words that add up to its sum."""
    count = words.shape[0]
    if n <= _BLOCK:
        sums = lax.reduce_sum(words, (words.ndim - 1,))  # below 2^32
        return [[sums[j]] for j in range(count)]
    blocks = -(-n // _BLOCK)
    padding = [(0, 0)] * (words.ndim - 1) + [(0, blocks * _BLOCK - n)]
    blocked = jnp.reshape(jnp.pad(words, padding), (*words.shape[:-1], blocks, _BLOCK))
    partial = lax.reduce_sum(blocked, (blocked.ndim - 1,))  # below 2^32 each
    # At most 2^16 blocks: the sums of the partial sums' 16-bit halves stay below 2^32.
    low = lax.reduce_sum(partial & _u32(0xFFFF), (partial.ndim - 1,))
    high = lax.reduce_sum(partial >> _u32(16), (partial.ndim - 1,))
    positions: list[list[Any]] = [[low[j]] for j in range(count)] + [[]]
    for j in range(count):
        positions[j + 1].append(high[j])
    return positions


def _limbs(positions: list[list[Any]], like: Any) -> list[Any]:
    """The 16-bit limbs (uint32 values below 2^16) of the integer those words make."""
    limbs = []
    carry = jnp.zeros_like(like)
    for words in [*positions, [], []]:  # two more limbs take the last carries
        low = carry & _u32(0xFFFF)
        high = carry >> _u32(16)
        for word in words:
            low = low + (word & _u32(0xFFFF))  # at most three terms below 2^16
            high = high + (word >> _u32(16))
        limbs.append(low & _u32(0xFFFF))
        carry = high + (low >> _u32(16))
    return limbs


def _round_integer(
    plus: list[list[Any]], minus: list[list[Any]], unit: Any, dtype: np.dtype[Any]
) -> Any:
    """``(plus - minus) * 2^unit`` rounded once, to nearest even, to the precision of
    ``dtype``, as float32 (flushed and overflowing as the fence has it)."""
    like = plus[0][0]
    p, q = _limbs(plus, like), _limbs(minus, like)
    undecided = jnp.ones(like.shape, bool)
    greater = jnp.zeros(like.shape, bool)
    for a, b in zip(reversed(p), reversed(q), strict=True):
        greater = greater | (undecided & (a > b))
        undecided = undecided & (a == b)
    negative = ~greater & ~undecided
    magnitude = []
    borrow = jnp.zeros(like.shape, jnp.int32)
    for a, b in zip(p, q, strict=True):
        big = jnp.where(negative, b, a).astype(jnp.int32)
        small = jnp.where(negative, a, b).astype(jnp.int32)
        difference = big - small - borrow
        borrow = (difference < 0).astype(jnp.int32)
        magnitude.append((difference + (borrow << 16)).astype(jnp.uint32))
    limbs = [jnp.zeros_like(like)] * 2 + magnitude  # a window of three limbs at the top
    top = jnp.zeros(like.shape, jnp.int32)
    window = jnp.zeros_like(like)  # the top two limbs
    below = jnp.zeros_like(like)  # the third
    lost = jnp.zeros(like.shape, bool)  # anything nonzero under the three
    nonzero_under = jnp.zeros(like.shape, bool)
    for k in range(2, len(limbs)):
        if k >= 3:
            nonzero_under = nonzero_under | (limbs[k - 3] != _u32(0))
        here = limbs[k] != _u32(0)
        top = jnp.where(here, k, top)
        window = jnp.where(here, (limbs[k] << _u32(16)) | limbs[k - 1], window)
        below = jnp.where(here, limbs[k - 2], below)
        lost = jnp.where(here, nonzero_under, lost)
    zero = window == _u32(0)
    # Normalise the 48-bit window so that its top bit is bit 31 of `head`.
    lead = lax.clz(jnp.where(zero, _u32(1 << 16), window))  # at most 15
    head = (window << lead) | ((below << lead) >> _u32(16))
    tail = (below << lead) & _u32(0xFFFF)
    bits = _PRECISION[np.dtype(dtype)]
    kept = head >> _u32(32 - bits)
    half = ((head >> _u32(31 - bits)) & _u32(1)) == _u32(1)
    sticky = ((head & _u32((1 << (31 - bits)) - 1)) != _u32(0)) | (tail != _u32(0)) | lost
    kept = kept + (half & (sticky | ((kept & _u32(1)) == _u32(1)))).astype(jnp.uint32)
    carry = kept >> _u32(bits)
    kept = jnp.where(carry == _u32(1), kept >> _u32(1), kept)
    # The window's bit 0 weighs 2^(16 (top - 4)) units, its top bit 2^(47 - lead) of it.
    exponent = 16 * top - lead.astype(jnp.int32) - 17 + unit + carry.astype(jnp.int32)
    sign = jnp.where(negative, _SIGN32, _u32(0))
    fraction = (kept << _u32(24 - bits)) & _FRACTION32
    biased = exponent + 127
    packed = sign | (jnp.clip(biased, 0, 255).astype(jnp.uint32) << _u32(23)) | fraction
    packed = jnp.where(biased >= 255, sign | _INF32, packed)
    tiny = (biased <= 0) | ((biased == 1) & (fraction == _u32(0)))
    packed = jnp.where(tiny, sign, packed)
    packed = jnp.where(zero, _u32(0), packed)
    return lax.bitcast_convert_type(packed, jnp.float32)


_PRECISION = {_F32: 24, np.dtype(jnp.float16): 11, np.dtype(jnp.bfloat16): 8}
