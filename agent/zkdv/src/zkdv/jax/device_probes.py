"""Probes (:mod:`zkdv.probes`) computed by XLA on the device that holds the parameters.

:func:`project` returns, for every input, the float32 bits of
:meth:`zkdv.probes.ProbeSet.project` on the host, so a transcript is byte-identical
whichever side computed its probes; only the probe values (a few KiB per step) leave
the device. It uses integer arithmetic only: no float64 (a TPU has none, and emulates
it inexactly), no ``jax.enable_x64``, no ``frexp``/``ldexp`` (whose lowerings shift
values of mixed signedness, which XLA's TPU compiler refuses) and no float matrix
product (a TPU's float32 ``HIGHEST`` product of small integers is not exact). Every
shift has operands of one dtype, and every shift amount is clamped below 32.

**The host's value.** (:mod:`zkdv.probes`, ``exact_rows``/``exact_finish``.) For a row
``v`` of float32 (subnormals flushed) with largest magnitude ``|v| < 2**e`` (``e`` the
``frexp`` exponent, 0 for a zero row) and ``w = slice_width(d)``, the host splits each
element into ``n1 = trunc(v * 2**(w - e))`` and ``n2 = trunc(frac(v * 2**(w - e)) *
2**w)``, multiplies both by the exact matrix ``q`` in float64 and returns
``float32(P1 / 2**(w - e) + P2 / 2**(2w - e))``. ``n1 * 2**w + n2`` is
``N = trunc(v * 2**(2w - e))`` (``trunc(x) * 2**w`` is an integer, so
``trunc(x * 2**w) = trunc(x) * 2**w + trunc(frac(x) * 2**w)``), ``|N| < 2**(2w)``.
Each column ``j`` of ``q`` is ``Q[:, j] * 2**c_j`` with integers ``|Q| < 2**w``
(``exact_matrix`` truncates each column to ``w`` bits below its largest exponent
``t_j``; ``c_j = t_j - w``). The float64 products are exact, so
``P1 / 2**(w - e) + P2 / 2**(2w - e) = X * 2**K`` with the exact integer
``X = sum_t N_t * Q[t, j]`` (``|X| < d * 2**(3w) <= 2**(L + 3w)``, ``L = ceil(log2 d)``,
at most 80 bits) and ``K = c_j + e - 2w``; both addends are exact float64 values, so
the addition rounds once: the host's value is ``RN24(RN53(X) * 2**K)``, a rounding to
float64's 53 bits then to float32's 24 (nearest, ties to even, both; the double
rounding is kept as it is, ties included). Scaling by ``2**K`` commutes with both
roundings: ``K >= -328`` and ``|X| < 2**80`` keep every intermediate a normal float64,
and what is not flushed below is a normal float32 or an overflow.
The host then flushes results below ``2**-126`` (on the float64 value) to ``+0``,
makes zeros positive and gives a row holding an infinity or NaN the NaN ``0x7FC00000``;
float32 overflow (``RN24 >= 2**128``) is an infinity.

**The device's steps, each exact.**

1. *Bits.* float32 leaves are bitcast to ``uint32``; bfloat16 is its 16 bits shifted
   up; float16 is widened from its fields (subnormals normalised with ``clz``), so no
   conversion whose rounding or flushing the device decides is involved. Wider floats
   are rounded to float32 by ``astype``, as the host does.
2. *Row exponent.* For float32 the order of magnitudes is that of the bits without the
   sign, so the peak is an integer maximum; at or above ``0x7F800000`` the row holds an
   infinity or NaN. A normal peak's exponent field ``E_p`` gives ``e = E_p - 126``; a row
   of zeros and subnormals flushes to zeros (``e = 0``).
3. *Digits of N.* A normal element is ``M * 2**(E - 150)`` (``M`` its 24-bit
   significand with the implicit bit, ``E`` its exponent field; ``E = 0``, subnormal or
   zero, is flushed: the host flushes subnormals only in rows where they could reach a
   slice, and elsewhere they give zero slices anyway), so ``|N| = floor(M * 2**s)``
   with ``s = E - 150 + 2w - e <= 2w - 24``. Its base-128 digit ``i`` is
   ``floor(M * 2**(s - 7i)) mod 128``: one uint32 shift (left when ``s - 7i >= 0``,
   where the wrap-around at ``2**32`` does not touch the low 7 bits; right otherwise;
   amounts of 32 or more give 0). ``ceil(2w/7)`` digits, each times the element's
   sign, are int8 in ``[-127, 127]``.
4. *Digits of Q.* The same, on the host, once (:func:`matrix_digits`): ``ceil(w/7)``
   signed digits per entry, and ``c_j`` per column.
5. *One int8 matmul.* Row digits stacked ``(digits_N * r, d)`` times matrix digits
   ``(d, digits_Q * k)``, accumulated in int32 (``preferred_element_type``; batched
   over the leaves of a class, below): entry ``(i, a; j, b)`` is
   ``S_ab = sum_t N_t[a] Q[t, j][b]``, so
   ``X = sum_ab S_ab * 2**(7(a + b))``. Each product is at most ``127**2 < 2**14``, so a
   sum of ``2**17`` terms is below ``2**31``: int32 cannot overflow, in any order. Rows
   longer than ``2**17`` are multiplied in blocks of ``2**17`` columns, one more ``S``
   per block (and refused above ``2**23``).
6. *Multi-limb X.* ``X`` is summed in base-``2**16`` limbs held in int32: each ``S``
   (below ``2**31`` in magnitude) is cut into ``lo = S mod 2**16`` and
   ``hi = floor(S / 2**16)``; with ``7(a + b) = 16p + m`` (``m < 16``), ``lo * 2**m``
   (below ``2**31``) and ``hi * 2**m`` (below ``2**30`` in magnitude) are cut again at
   16 bits, and the pieces (each below ``2**17`` in magnitude) are added to limbs
   ``p, p + 1, p + 2``: at most ``3 * 32 * blocks`` pieces per limb, far below
   ``2**31``. Carries are propagated with arithmetic shifts (floor division), which
   leaves limbs in ``[0, 2**16)`` and a top limb of 0 or -1 (the sign); a negative
   ``X`` is negated limb by limb and propagated again: ``|X|`` in 16-bit limbs.
7. *The host's double rounding.* ``B``, the bit length of ``|X|``, from the highest
   nonzero limb and ``clz``; the 64 bits ``G = floor(|X| / 2**(B - 64))`` (four 16-bit
   words gathered with selects, for ``B < 64`` shifted up with zeros) and a sticky bit
   for every bit below them. RN53: the top 53 bits of ``G`` (a 21-bit and a 32-bit
   word), rounded up when the next bit is 1 and any lower bit (sticky included) or the
   last kept bit is 1; a carry out of 53 bits makes ``2**52`` and ``B + 1``. RN24 of
   that 53-bit value the same way, with only ITS lower bits as sticky (the host
   rounds ``RN53(X)``, not ``X``). Flush when ``X = 0`` or ``B53 + K <= -126`` (then
   ``RN53(X) * 2**K < 2**-126``; otherwise it is at least ``2**-126``); the float32
   exponent field is ``B24 + K + 126``, an infinity at 255 or above.

*The program's layout.* :class:`DeviceProbes` projects the leaves with the same row
length and number of probed rows together (a class): steps 2-5 per class (one batched
matmul each), then steps 6 and 7 once for every probe of the tree, the classes'
products padded with zero products to common digit counts (zeros add nothing to the
sums). The program's size grows with the number of classes only by their digits and
matmuls, not with the number of leaves or digit pairs.

Measured on a TPU v5e (2026-12-05): int8 x int8 -> int32 products are exact, integer
shifts of 32 or more give 0 (logical) or the sign (arithmetic), and nothing above uses
float arithmetic at all. ``tests/agent/zkdv/jax/test_device_probes.py`` checks the
bits against the host on adversarial rows and lowers the program for TPU on a CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv.probes import CANONICAL_NAN, ProbeSet, slice_width

__all__ = ["DeviceProbes", "IntegerMatrix", "matrix_digits", "project"]

#: Bits per digit of the int8 products: a digit times a digit is below ``2**14``.
DIGIT_BITS = 7
#: Terms one int32 sum of digit products may hold: ``2**17 * 127**2 < 2**31``.
BLOCK_TERMS = 2**17
#: Longest row :func:`project` takes: 64 blocks keep the limb sums far below ``2**31``.
MAX_TERMS = 2**23
_LIMB = 16
_MASK16 = 0xFFFF


class IntegerMatrix(NamedTuple):
    """An exact probe matrix as the device multiplies it (:func:`matrix_digits`).

    Attributes:
        digits: ``(d, count * k)`` int8, the ``count`` signed base-128 digits of the
            integer matrix ``Q``, digit-major (columns ``i * k : (i + 1) * k`` are
            digit ``i``).
        exponents: ``(k,)`` int32: column ``j`` of the float matrix is
            ``Q[:, j] * 2**exponents[j]``.
    """

    digits: Any
    exponents: Any


def _digit_count(bits: int) -> int:
    return -(-bits // DIGIT_BITS)


def matrix_digits(matrix: np.ndarray) -> IntegerMatrix:
    """The integer digits of an exact probe matrix (float32 ``(d, k)``), on the host.

    Raises:
        ValueError: when the matrix is not exact (:func:`zkdv.probes.exact_matrix`): an
            entry that is not an integer multiple of ``2**(t_j - w)``, ``t_j`` its
            column's largest ``frexp`` exponent, or not finite.
    """
    q = np.asarray(matrix, dtype=np.float32).astype(np.float64)
    d = q.shape[0]
    width = slice_width(d)
    if not np.isfinite(q).all():
        raise ValueError(f"probe matrix of shape {q.shape}: holds an infinity or NaN")
    _, top = np.frexp(np.abs(q).max(axis=0, initial=0.0))
    exponents = (top - width).astype(np.int32)
    scaled = np.ldexp(q, -exponents[None, :].astype(np.int64))  # exact: a power of two
    if not np.array_equal(scaled, np.trunc(scaled)):
        raise ValueError(
            f"probe matrix of shape {q.shape}: not an exact matrix (an entry has bits "
            f"below {width} bits of its column's largest; zkdv.probes.exact_matrix)"
        )
    integers = scaled.astype(np.int64)
    magnitude, negative = np.abs(integers), integers < 0
    digits = []
    for i in range(_digit_count(width)):
        digit = (magnitude >> (DIGIT_BITS * i)) & 127
        digits.append(np.where(negative, -digit, digit))
    stacked = np.concatenate(digits, axis=1) if digits else np.zeros((d, 0), np.int64)
    return IntegerMatrix(stacked.astype(np.int8), exponents)


def _u32(value: int) -> Any:
    return jnp.uint32(value)


def _i32(value: int) -> Any:
    return jnp.int32(value)


def _shift(x: Any, amount: Any) -> Any:
    """``floor(x * 2**amount) mod 2**32`` for uint32 ``x`` and int32 ``amount``.

    XLA's shifts by 32 or more are defined (0 for these), but the amounts are clamped
    anyway: the result does not depend on any backend's handling of them.
    """
    left = lax.shift_left(x, jnp.clip(amount, _i32(0), _i32(31)).astype(jnp.uint32))
    right = lax.shift_right_logical(x, jnp.clip(-amount, _i32(0), _i32(31)).astype(jnp.uint32))
    zero = jnp.zeros_like(x)
    return jnp.where(
        amount >= _i32(0),
        jnp.where(amount > _i32(31), zero, left),
        jnp.where(amount < _i32(-31), zero, right),
    )


def _half_bits(half: Any) -> Any:
    """The float32 bits of float16 values given as uint32 (exact: every float16 is a
    float32; subnormals become normal float32s)."""
    sign = lax.shift_left(half & _u32(0x8000), _u32(16))
    exponent = lax.shift_right_logical(half, _u32(10)) & _u32(0x1F)
    mantissa = half & _u32(0x3FF)
    normal = lax.shift_left(exponent + _u32(112), _u32(23)) | lax.shift_left(mantissa, _u32(13))
    special = _u32(0x7F800000) | lax.shift_left(mantissa, _u32(13))
    # A subnormal m * 2**-24 with its top bit at p is 2**(p - 24) * 1.f: field p + 103.
    nonzero = jnp.maximum(mantissa, _u32(1))
    top = _u32(31) - lax.clz(nonzero)
    fraction = lax.shift_left(nonzero, _u32(23) - top) & _u32(0x7FFFFF)
    subnormal = lax.shift_left(top + _u32(103), _u32(23)) | fraction
    small = jnp.where(mantissa == _u32(0), _u32(0), subnormal)
    body = jnp.where(exponent == _u32(31), special, jnp.where(exponent == _u32(0), small, normal))
    return sign | body


def float32_bits(values: Any) -> Any:
    """The uint32 bits of ``values`` as float32 (half precision widened exactly, from
    the bits; wider floats rounded by ``astype``, as :meth:`ProbeSet.select` does)."""
    dtype = jnp.dtype(values.dtype)
    if dtype == jnp.float32:
        return lax.bitcast_convert_type(values, jnp.uint32)
    if dtype == jnp.bfloat16:
        wide = lax.bitcast_convert_type(values, jnp.uint16).astype(jnp.uint32)
        return lax.shift_left(wide, _u32(16))
    if dtype == jnp.float16:
        return _half_bits(lax.bitcast_convert_type(values, jnp.uint16).astype(jnp.uint32))
    return lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32)


def _row_digits(bits: Any, width: int) -> tuple[Any, Any, Any]:
    """Steps 2 and 3 for bits ``(n, r, d)``: the signed digits ``(n, count * r, d)``
    int8 of every element's ``N`` (digit-major), each row's exponent ``e`` (int32
    ``(n, r)``) and whether it holds an infinity or NaN."""
    magnitude = bits & _u32(0x7FFFFFFF)
    peak = jnp.max(magnitude, axis=-1)
    bad = peak >= _u32(0x7F800000)
    peak_field = lax.shift_right_logical(peak, _u32(23)).astype(jnp.int32)
    top = jnp.where(peak_field > _i32(0), peak_field - _i32(126), _i32(0))
    field = lax.shift_right_logical(magnitude, _u32(23)).astype(jnp.int32)
    significand = (magnitude & _u32(0x7FFFFF)) | _u32(0x800000)
    keep = (field > 0) & ~bad[..., None]
    significand = jnp.where(keep, significand, _u32(0))
    shift = field + (2 * width - 150) - top[..., None]
    negative = bits >= _u32(0x80000000)
    count = _digit_count(2 * width)
    steps = jnp.asarray(DIGIT_BITS * np.arange(count), jnp.int32)[:, None, None, None]
    digits = (_shift(significand[None], shift[None] - steps) & _u32(127)).astype(jnp.int8)
    digits = jnp.where(negative[None], -digits, digits)
    n, rows, d = bits.shape
    return digits.transpose(1, 0, 2, 3).reshape(n, count * rows, d), top, bad


def _products(digits: Any, matrix: Any) -> Any:
    """Step 5: the int32 digit products ``(blocks, n, count_N * r, count_Q * k)``, one
    batched int8 matmul per block of at most :data:`BLOCK_TERMS` columns."""
    d = digits.shape[-1]
    out = []
    for start in range(0, d, BLOCK_TERMS):
        stop = min(d, start + BLOCK_TERMS)
        out.append(
            lax.dot_general(
                digits[..., start:stop],
                matrix[:, start:stop],
                (((2,), (1,)), ((0,), (0,))),
                preferred_element_type=jnp.int32,
            )
        )
    return jnp.stack(out)


def _propagate(limbs: list[Any]) -> list[Any]:
    """Carries from each int32 limb into the next: limbs in ``[0, 2**16)`` below a top
    limb holding the rest (arithmetic shift: floor division, for negative limbs too)."""
    out = list(limbs)
    for i in range(len(out) - 1):
        out[i + 1] = out[i + 1] + lax.shift_right_arithmetic(out[i], _i32(_LIMB))
        out[i] = out[i] & _i32(_MASK16)
    return out


def _canonical(products: Any, counts: tuple[int, int]) -> Any:
    """A class's products ``(blocks, n, count_N * r, count_Q * k)`` as
    ``(blocks, count_N, count_Q, n * r * k)``: digit pairs first, then every probe."""
    row_count, matrix_count = counts
    blocks, n, _, _ = products.shape
    rows, k = products.shape[2] // row_count, products.shape[3] // matrix_count
    pairs = products.reshape(blocks, n, row_count, rows, matrix_count, k)
    return pairs.transpose(0, 2, 4, 1, 3, 5).reshape(blocks, row_count, matrix_count, -1)


def _sums(products: Any, limbs: int) -> Any:
    """Step 6's sums: ``X`` as ``limbs`` int32 limbs ``(limbs, E)`` of weight
    ``2**(16 i)``, not yet carried (each below ``2**30`` in magnitude), from the
    products ``(blocks, count_N, count_Q, E)`` of every probe.

    The digit pairs are ordered by weight ``a + b`` first, so each limb's pieces are
    contiguous slices: one sum per slice, not one operation per pair (the program
    stays small, and compiles in seconds).
    """
    blocks, row_count, matrix_count, entries = products.shape
    weight = DIGIT_BITS * np.add.outer(np.arange(row_count), np.arange(matrix_count)).ravel()
    order = np.argsort(weight, kind="stable")
    weight = weight[order]
    pairs = products.reshape(blocks, row_count * matrix_count, entries)
    pairs = jnp.take(pairs, jnp.asarray(order, jnp.int32), axis=1)
    offset = jnp.asarray((weight % _LIMB)[None, :, None], jnp.int32)
    low = lax.shift_left(pairs & _i32(_MASK16), offset)
    high = lax.shift_left(lax.shift_right_arithmetic(pairs, _i32(_LIMB)), offset)
    pieces = (
        low & _i32(_MASK16),
        lax.shift_right_arithmetic(low, _i32(_LIMB)) + (high & _i32(_MASK16)),
        lax.shift_right_arithmetic(high, _i32(_LIMB)),
    )
    place = weight // _LIMB
    assert place.max() + 2 < limbs, "a piece above the top limb"
    total = []
    for limb in range(limbs):
        summed = jnp.zeros((entries,), jnp.int32)
        for lift, piece in enumerate(pieces):
            chosen = np.flatnonzero(place + lift == limb)
            if len(chosen):
                part = piece[:, int(chosen[0]) : int(chosen[-1]) + 1]
                summed = summed + jnp.sum(part, axis=(0, 1), dtype=jnp.int32)
        total.append(summed)
    return jnp.stack(total)


def _at(limbs: list[Any], index: Any) -> Any:
    """The limb at a per-entry ``index`` (0 outside the number), by selects."""
    out = jnp.zeros_like(limbs[0])
    for i, limb in enumerate(limbs):
        out = jnp.where(index == _i32(i), limb, out)
    return out


def _window(limbs: list[Any]) -> tuple[Any, list[Any], Any]:
    """Step 7's start: the bit length ``B`` of ``|X|`` (int32), the four 16-bit words
    (uint32, lowest first) of ``floor(|X| / 2**(B - 64))`` and whether a bit below
    them is set."""
    words = [limb.astype(jnp.uint32) for limb in limbs]
    length = jnp.zeros(limbs[0].shape, jnp.int32)
    for i, word in enumerate(words):
        bits = _i32(32) - lax.clz(word).astype(jnp.int32)
        length = jnp.where(word != _u32(0), _i32(_LIMB * i) + bits, length)
    start = length - 64
    place = lax.shift_right_arithmetic(start, _i32(4))  # floor(start / 16)
    offset = (start & _i32(15)).astype(jnp.uint32)
    window = []
    for o in range(4):
        low = lax.shift_right_logical(_at(words, place + o), offset)
        high = lax.shift_left(_at(words, place + o + 1), _u32(_LIMB) - offset)
        window.append((low | high) & _u32(_MASK16))
    sticky = jnp.zeros(limbs[0].shape, bool)
    for i, word in enumerate(words):
        below = jnp.clip(start - _i32(_LIMB * i), _i32(0), _i32(_LIMB)).astype(jnp.uint32)
        mask = lax.shift_left(_u32(1), below) - _u32(1)
        sticky = sticky | ((word & mask) != _u32(0))
    return length, window, sticky


def _round_up(keep: Any, half: Any, sticky: Any) -> Any:
    """Round to nearest, ties to even: whether to add one to the kept bits ``keep``."""
    return half & (sticky | ((keep & _u32(1)) != _u32(0)))


def _double_round(window: list[Any], sticky: Any) -> tuple[Any, Any, Any]:
    """Step 7: ``RN24(RN53(G))`` of the 64-bit window: the 24-bit significand (uint32)
    and the carries (int32 0/1) of the 53-bit and of the 24-bit rounding."""
    g0, g1, g2, g3 = window
    low = (
        lax.shift_right_logical(g0, _u32(11))
        | lax.shift_left(g1, _u32(5))
        | lax.shift_left(g2, _u32(21))
    )
    high = lax.shift_right_logical(g2, _u32(11)) | lax.shift_left(g3, _u32(5))
    half = (g0 & _u32(0x400)) != _u32(0)
    up = _round_up(low, half, sticky | ((g0 & _u32(0x3FF)) != _u32(0)))
    low = low + up.astype(jnp.uint32)
    high = high + (up & (low == _u32(0))).astype(jnp.uint32)
    carry53 = high == _u32(1 << 21)
    high = jnp.where(carry53, _u32(1 << 20), high)
    kept = lax.shift_left(high, _u32(3)) | lax.shift_right_logical(low, _u32(29))
    half = (low & _u32(1 << 28)) != _u32(0)
    up = _round_up(kept, half, (low & _u32((1 << 28) - 1)) != _u32(0))
    kept = kept + up.astype(jnp.uint32)
    carry24 = kept == _u32(1 << 24)
    kept = jnp.where(carry24, _u32(1 << 23), kept)
    return kept, carry53.astype(jnp.int32), carry24.astype(jnp.int32)


def _limb_count(width: int, d: int, row_count: int, matrix_count: int) -> int:
    """Limbs holding every piece of step 6 and ``|X| < 2**(L + 3w)`` with its sign."""
    pieces = (DIGIT_BITS * (row_count + matrix_count - 2)) // _LIMB + 3
    magnitude = max(0, d - 1).bit_length() + 3 * width
    return max(pieces, magnitude // _LIMB + 2)


class _Products(NamedTuple):
    """Steps 2-5 of one class: what steps 6-7 need, for its ``E = n * r * k`` probes."""

    products: Any  # (blocks, count_N, count_Q, E) int32
    scale: Any  # (E,) int32: K
    bad: Any  # (E,) bool: the row holds an infinity or NaN
    limbs: int  # limbs that hold its X


def _class_products(bits: Any, matrix: IntegerMatrix) -> _Products:
    """Steps 2-5 for ``n`` row blocks given as float32 bits ``(n, r, d)`` against ``n``
    stacked matrices (digits ``(n, d, count * k)``, exponents ``(n, k)``)."""
    n, rows, d = bits.shape
    k = matrix.exponents.shape[-1]
    if d > MAX_TERMS:
        raise ValueError(f"probe rows of {d} elements: at most {MAX_TERMS} are supported")
    width = slice_width(d)
    digits, top, bad = _row_digits(bits, width)
    counts = (_digit_count(2 * width), _digit_count(width))
    products = _canonical(_products(digits, matrix.digits), counts)
    exponents = jnp.asarray(matrix.exponents, jnp.int32)
    scale = top[..., None] + exponents[:, None, :] - _i32(2 * width)
    bad = jnp.broadcast_to(bad[..., None], (n, rows, k))
    limbs = _limb_count(width, d, *counts)
    return _Products(products, scale.reshape(-1), bad.reshape(-1), limbs)


def _finish(sums: Any, scale: Any, bad: Any) -> Any:
    """Steps 6 (carries, sign) and 7 for every entry of the uncarried limbs ``sums``
    ``(limbs, E)``, scales and bad rows ``(E,)``: the probes' float32 ``(E,)``."""
    limbs = _propagate(list(sums))
    negative = limbs[-1] < 0
    limbs = _propagate([jnp.where(negative, -limb, limb) for limb in limbs])
    length, window, sticky = _window(limbs)
    significand, carry53, carry24 = _double_round(window, sticky)
    flush = (length == 0) | (length + carry53 + scale <= -126)
    field = length + carry53 + carry24 + scale + 126
    finite = lax.shift_left(jnp.clip(field, _i32(0), _i32(255)).astype(jnp.uint32), _u32(23)) | (
        significand & _u32(0x7FFFFF)
    )
    out = jnp.where(field >= 255, _u32(0x7F800000), finite)
    out = out | jnp.where(negative, _u32(0x80000000), _u32(0))
    out = jnp.where(flush, _u32(0), out)
    out = jnp.where(bad, _u32(int(CANONICAL_NAN)), out)
    return lax.bitcast_convert_type(out, jnp.float32)


def _project_classes(blocks: Sequence[tuple[Any, IntegerMatrix]]) -> list[Any]:
    """The exact probes ``(n, r, k)`` float32 of each ``(bits, matrix)`` class.

    Steps 2-5 per class; then the products of every class, padded with zero products
    to the same digit counts and blocks (which adds zeros to the sums), go through
    steps 6-7 together: the program's size grows with the classes only by their
    matmuls and digits."""
    shapes = [(bits.shape[0], bits.shape[1], m.exponents.shape[-1]) for bits, m in blocks]
    live = [
        i
        for i, ((n, rows, k), (bits, _)) in enumerate(zip(shapes, blocks, strict=True))
        if n * rows * k and bits.shape[2]
    ]
    parts = [_class_products(*blocks[i]) for i in live]
    out = [jnp.zeros(shape, jnp.float32) for shape in shapes]
    if not parts:
        return out
    size = tuple(max(part.products.shape[axis] for part in parts) for axis in range(3))
    padded = [
        jnp.pad(
            part.products,
            [(0, size[axis] - part.products.shape[axis]) for axis in range(3)] + [(0, 0)],
            constant_values=_i32(0),
        )
        for part in parts
    ]
    limbs = max(_limb_count(0, 1, size[1], size[2]), *(part.limbs for part in parts))
    flat = _finish(
        _sums(jnp.concatenate(padded, axis=3), limbs),
        jnp.concatenate([part.scale for part in parts]),
        jnp.concatenate([part.bad for part in parts]),
    )
    start = 0
    for i in live:
        count = int(np.prod(shapes[i]))
        out[i] = flat[start : start + count].reshape(shapes[i])
        start += count
    return out


def project(values: Any, matrix: IntegerMatrix | np.ndarray) -> Any:
    """The exact probe of rows ``(r, d)`` (float32, or half precision widened exactly)
    against an exact matrix: the float32 bits of :meth:`zkdv.probes.ProbeSet.project`.

    Args:
        values: the probed rows.
        matrix: the matrix's :class:`IntegerMatrix`, or the float32 exact matrix
            itself (then converted by :func:`matrix_digits` while tracing).

    Raises:
        ValueError: for rows longer than :data:`MAX_TERMS`.
    """
    if not isinstance(matrix, IntegerMatrix):
        matrix = matrix_digits(np.asarray(matrix))
    stacked = IntegerMatrix(jnp.asarray(matrix.digits)[None], jnp.asarray(matrix.exponents)[None])
    return _project_classes([(float32_bits(values)[None], stacked)])[0][0]


def _rows(leaf: Any, rows: int, d: int, selected: Any | None) -> Any:
    values = jnp.reshape(leaf, (rows, d))
    if selected is not None:
        values = jnp.take(values, selected, axis=0, mode="clip")
    return float32_bits(values)


class _Class(NamedTuple):
    """Leaves projected together: the same row length, probed rows and columns."""

    leaves: tuple[int, ...]
    rows: int
    d: int


def _classes(layout: Sequence[tuple[int, int, int]], rows: Sequence[int]) -> tuple[_Class, ...]:
    members: dict[tuple[int, int, int], list[int]] = {}
    for leaf, ((_, d, k), n) in enumerate(zip(layout, rows, strict=True)):
        members.setdefault((n, d, k), []).append(leaf)
    return tuple(_Class(tuple(leaves), n, d) for (n, d, _), leaves in members.items())


def _probe_all(
    layout: tuple[tuple[int, int, int], ...],
    classes: tuple[_Class, ...],
    leaves: Sequence[Any],
    matrices: Sequence[IntegerMatrix],
    selections: Sequence[Any | None],
) -> Any:
    """Every leaf's probes, one batched projection per class (the program's size grows
    with the number of classes, not of leaves). The probe seed's choices (the matrices'
    digits, the probed rows) are arguments, not constants, so runs of one layout share
    one program (and XLA's persistent cache finds it for every run and replay)."""
    blocks = [
        (
            jnp.stack(
                [_rows(leaves[i], layout[i][0], group.d, selections[i]) for i in group.leaves]
            ),
            matrix,
        )
        for group, matrix in zip(classes, matrices, strict=True)
    ]
    results: dict[int, Any] = {}
    for group, probes in zip(classes, _project_classes(blocks), strict=True):
        for position, leaf in enumerate(group.leaves):
            results[leaf] = probes[position].reshape(-1)
    parts = [results[leaf] for leaf in range(len(layout))]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


class DeviceProbes:
    """One run's probe matrices on a device and the compiled program that projects a tree.

    Args:
        probes: the run's :class:`~zkdv.probes.ProbeSet` (created by the core when the
            transcript opens).
        device: where the parameters live; the matrices' integer digits
            (:func:`matrix_digits`, worked out here once) are placed there. None: JAX's
            default placement.
    """

    def __init__(self, probes: ProbeSet, device: Any = None) -> None:
        self.probes = probes
        self.layout = tuple(
            (rows, last, matrix.shape[1])
            for (rows, last), matrix in zip(probes.row_shapes, probes.matrices, strict=True)
        )
        probed = [
            rows if sel is None else len(sel)
            for (rows, _, _), sel in zip(self.layout, probes.rows, strict=True)
        ]
        self.sizes = [n * k for n, (_, _, k) in zip(probed, self.layout, strict=True)]
        # Leaves of one class are projected by one batched program (module docstring).
        self.classes = _classes(self.layout, probed)
        self.matrices = []
        for group in self.classes:
            parts = [matrix_digits(probes.matrices[leaf]) for leaf in group.leaves]
            self.matrices.append(
                IntegerMatrix(
                    jax.device_put(np.stack([p.digits for p in parts]), device),
                    jax.device_put(np.stack([p.exponents for p in parts]), device),
                )
            )
        #: Each leaf's probed rows (None: all), on the device: an argument of the program.
        self.selections = [
            None if sel is None else jax.device_put(np.asarray(sel, np.int32), device)
            for sel in probes.rows
        ]
        self._program = jax.jit(functools.partial(_probe_all, self.layout, self.classes))

    @property
    def floats(self) -> int:
        return sum(self.sizes)

    def program(self) -> Any:
        """The jitted program :meth:`__call__` runs: ``(leaves, matrices, selections) ->
        probes`` (for lowering it elsewhere, e.g. ``jax.export`` for another platform)."""
        return self._program

    def __call__(self, leaves: Sequence[Any]) -> jax.Array:
        """Dispatch the probes of one parameter tree (post-update, delta or pre-update):
        one float32 vector, leaf after leaf, each ``(rows, k)`` in C order."""
        result: jax.Array = self._program(list(leaves), self.matrices, self.selections)
        return result

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """The host copy of :meth:`__call__`'s result as one ``(rows, k)`` array per leaf."""
        out = []
        offset = 0
        for size, (rows, _, k), selected in zip(
            self.sizes, self.layout, self.probes.rows, strict=True
        ):
            n = rows if selected is None else len(selected)
            out.append(flat[offset : offset + size].reshape(n, k))
            offset += size
        return out
