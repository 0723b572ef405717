"""Evaluate small elementwise JAX functions (an Optax update) bit for bit reproducibly.

:func:`canonical` traces a function to a jaxpr and evaluates it equation by equation
with the rules below, emitting ordinary JAX operations: the result works under
``jax.jit``, inside a larger traced program and under ``jax.export``, and its float
results are the same bits on every XLA CPU instruction set (``--xla_cpu_max_isa`` =
SSE4_2, AVX, AVX2, AVX512), on TPUs (measured on a v5e against the CPU's) and, by
construction, on GPUs. ZKDV runs an optimizer's update this way so that the lab's
training and the platform's replay on other hardware compute the same post-update state
from the same committed gradient.

Usage (``tx`` an ``optax.GradientTransformation``; the zero is an argument of the
compiled program)::

    def apply(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(lambda zero, *args: canonical(apply, zero)(*args))
    params, opt_state = step(np.uint32(0), grads, opt_state, params)

Why plain XLA is not reproducible: XLA contracts ``a * b + c`` into a fused multiply-add
on hardware that has one (AVX2, AVX-512, GPUs) and not elsewhere; its ``exp``, ``log``,
``rsqrt``... are its own approximations and differ between instruction sets; a TPU's
float32 division and square root are not correctly rounded, and it has no IEEE float64
(XLA emulates float64 there); XLA CPU flushes subnormal results to zero and GPUs do not;
the order of a reduction's additions is the backend's choice; by default XLA keeps some
bfloat16 results in float32 (``xla_allow_excess_precision``); and NaN payloads depend on
the hardware.

Definition ``zkdv-jax-canonical-v2``
------------------------------------
Version 2 computes float32 and narrower values without float64 anywhere, so that a TPU
gives the CPU's bits (version 1 evaluated its formulas in float64, which a TPU emulates
inexactly: the canonical Adam update moved parameters by hundreds on a v5e). Only the
operations measured exact on every backend are used: float32 ``add``, ``sub`` and ``mul``
(IEEE-754, round to nearest even), integer and bitwise operations, comparisons, selects
and bitcasts.

*Fence.* Every floating-point value that an operation produces (and every input and
constant) passes through ``fence(x)``: its bits are OR-ed with ``zero``, a uint32 0 that
is a *runtime* input of the program, so XLA cannot see through it and cannot fuse the
operations on either side (every operation is rounded on its own); then a value whose
magnitude is at most the format's smallest normal number becomes a zero of the same
sign. XLA CPU and TPUs flush subnormal results to zero and GPUs do not; flushing all
agrees. The smallest normal itself is flushed too: flush-to-zero hardware detects
tininess after rounding and returns zero for a few results that a subnormal-capable one
rounds up to the smallest normal. Operations that only move, select or negate values
need no fence (their operands are fenced); conversions do.

*NaN.* Every NaN in a result, and in a value reinterpreted as bits
(``bitcast_convert_type``), is the positive quiet NaN (``0x7FC00000`` for float32). A
NaN's payload and sign depend on the hardware, but a NaN operand always gives a NaN
and compares the same, so the payload is fixed only where it becomes visible.

*Exactly rounded operations.* ``add``, ``sub``, ``mul``, ``div`` and ``sqrt`` of float32
give the IEEE-754 result (round to nearest even, then the fence's flush): ``add``,
``sub`` and ``mul`` natively; ``div`` by long division of the significands in 32-bit
integers, 25 quotient bits and a sticky bit, rounded once; ``sqrt`` digit by digit on
the significand, likewise. Every arithmetic operation of float16 and bfloat16 is
computed in float32 so and rounded once to the result type: float32 has at least twice
their precision plus two bits, so the result is the correctly rounded one. Float64 values
(only under ``jax_enable_x64``) operate natively in float64, which is IEEE on CPUs and
GPUs but not on a TPU: float64 optimizer state is canonical on CPUs and GPUs only; a
float64 divisor is tied to its dividend so that XLA's simplifier cannot turn a division
by a broadcast scalar into a product by its reciprocal. ``rsqrt(x)`` is ``1 / sqrt(x)``,
each correctly rounded.

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
bits of its type), each product rounded (in float32 for float32 and narrower), so
``x^n`` is within about ``log2 n + popcount n`` half-ulps; a negative exponent takes
``1 / x^|n|``. ``pow`` with a literal exponent of 0.5 or -0.5 is ``sqrt(x)`` or
``1 / sqrt(x)`` (of ``|x|`` for ``x = -0`` and ``-inf``, as C99's ``pow`` has it). Any
other ``pow(x, y)`` is ``exp(y * log|x|)``, accurate to about ``(1 + |y log x|)`` ulps,
with C99's special cases (``pow(x, 0) = 1``, ``pow(1, y) = 1``, ``pow(-1, +-inf) = 1``, a
negative base with an odd integer exponent negates, with a non-integer one gives NaN).

*Transcendentals* (``exp``, ``exp2``, ``log``, ``log1p``, ``expm1``, ``sin``, ``cos``,
``tan``, ``tanh``, ``logistic``, ``sinh``, ``cosh``): the formulas of
``zkdv.jax._canonical_arithmetic`` (Cody-Waite range reduction with fdlibm's split
constants, Taylor polynomials with the coefficients nearest to ``1/k!`` and
``1/(2k+1)``, evaluated by Horner's rule), every operation fenced, in float32 for
float32 and narrower values (accurate to a few float32 ulps, as a float32 libm is;
``sin``, ``cos`` and ``tan`` are accurate for ``|x| < 2^7 * pi/2`` and merely
deterministic beyond) and in float64 for float64 values (a few float64 ulps).

*Sums.* ``reduce_sum`` of float32 and narrower values is exact in integers, independent
of the order of the terms and of the additions, and rounded once: each finite term
``s * m * 2^(E - 150)`` becomes the integer ``trunc(m * 2^(E - M + L + 9))`` (``M`` the
largest exponent field among the terms, ``L = ceil(log2 n)``), which loses less than
``2^-32`` of the largest term over all ``n`` terms; the integers are cut into 16-bit
digits whose sums, positive and negative terms apart, cannot overflow 32 bits (sums of
more than ``2^16`` terms go by blocks); the digit sums are carried into one integer and
rounded to nearest even to the result's precision. Infinite and NaN terms are summed
apart (any order gives the same inf or NaN). Float64 sums are exact-then-rounded by
float64 levels, as in version 1.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zkdv.jax import _canonical_rules
from zkdv.jax._canonical_arithmetic import CANONICAL_VERSION, NotCanonical
from zkdv.jax._canonical_rules import _Evaluator

__all__ = ["CANONICAL_VERSION", "NotCanonical", "canonical", "check", "stack_limit"]


def canonical(function: Callable[..., Any], zero: Any) -> Callable[..., Any]:
    """Wrap ``function`` so that it is evaluated by the ``zkdv-jax-canonical-v2`` rules.

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

        # Traced and evaluated with the caller's x64 setting: that is the function's
        # meaning, and nothing in the rules needs float64 for narrower values.
        closed, shapes = jax.make_jaxpr(flat, return_shape=True)(*leaves)
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


@contextmanager
def stack_limit(limit: int | None = None) -> Iterator[int]:
    """Stack the canonical update's leaves of at most ``limit`` elements while open.

    An internal API, for ``bench/tpu_overhead.py`` (``--stack-limit``,
    ``--compare-stack-limits``), which weighs the stack's copies at every step against
    its shorter compile. Leaves of one shape, of more than 16 elements and at most
    ``limit``, are evaluated as one stacked array (0: none, each leaf on its own); the
    bits are the same either way. The limit is read when :func:`canonical` traces, so it
    applies to the programs traced inside the block (a proof's first step builds its
    update's); it holds for every caller in the process and is restored on exit.

    Args:
        limit: the largest leaf stacked, in elements; None leaves it as it is.

    Yields:
        The limit in force inside the block.
    """
    previous = _canonical_rules.STACK_LIMIT
    if limit is not None:
        _canonical_rules.STACK_LIMIT = limit
    try:
        yield _canonical_rules.STACK_LIMIT
    finally:
        _canonical_rules.STACK_LIMIT = previous
