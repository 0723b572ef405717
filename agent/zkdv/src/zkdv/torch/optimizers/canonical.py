"""Canonical optimizer updates: bitwise reproducible on any hardware.

A ZKDV training run applies this update instead of ``torch.optim``'s native step, and
the platform's replay applies it to the committed gradient on another machine; both
must produce the same bits. ``torch.optim``'s own kernels do not: ``lerp``,
``addcmul``, ``addcdiv`` and ``add(alpha=...)`` fuse a multiply and an add differently
on each CPU kernel family and on GPUs, and CPU ``sqrt`` is not correctly rounded.
This module follows ``torch.optim``'s mathematics (the same formulas and option
semantics, so training behaves the same up to rounding) but defines its own rounding.

The definition, **zkdv-torch-canonical-v1**:

1. *Dtypes.* Tensor arithmetic is float32. Parameters, gradients and state entries of
   bfloat16 or float16 are upcast to float32 (exact); each new value is rounded back
   to the dtype of the tensor it is stored in once, at the end of the update
   (``.to(dtype)``: round to nearest, ties to even). Within one update, every value
   (a new state entry included) is used at float32. A NaN is stored as the positive
   quiet NaN with a zero payload (float32 0x7FC00000, bfloat16 0x7FC0, float16
   0x7E00), whatever NaN the arithmetic produced. float64, complex and sparse
   tensors have no canonical update.
2. *Tensor operations.* Only ``a + b``, ``a - b``, ``a * b`` (tensor by tensor, or by a
   float32-representable Python number), ``torch.neg``, ``torch.abs``,
   ``torch.maximum`` (and ``torch.isnan``/``torch.where`` for NaNs), each one
   IEEE-754 float32 operation rounded separately, in the order written below. Division and square root go through float64:
   ``div32(a, b) = float32(float64(a) / float64(b))`` and
   ``sqrt32(a) = float32(sqrt(float64(a)))``, both the correctly rounded float32 result.
3. *Host scalars.* Every number a tensor is multiplied by or added to is computed on the
   host in Python float64 (IEEE-754 binary64, each operation correctly rounded,
   evaluated left to right as written), then rounded once to float32 (``f32``, ties to
   even). Integer powers ``beta^t`` are :func:`_power` (square-and-multiply), not
   ``**`` (libm ``pow`` is not correctly rounded and differs across C libraries);
   square roots are ``math.sqrt`` (correctly rounded); NAdam's real power ``0.96^x``
   is :func:`_real_power`, built from ``+ - * /`` only. ``t`` is the parameter's
   ``step`` entry after it is incremented by one, as ``torch.optim`` increments it
   (in place, in its own dtype and device), read as an integer.
4. *Formulas*, per parameter, after ``g = -g`` when ``maximize``. ``b1, b2 = betas``;
   ``f32(...)`` marks a host scalar; every other operation is one tensor operation.

   Adam: ``g = g + p * f32(wd)`` (when ``wd != 0``); ``m = m * f32(b1) + g * f32(1 - b1)``;
   ``v = v * f32(b2) + (g * g) * f32(1 - b2)``; with amsgrad ``vmax = maximum(vmax, v)``
   and ``vhat = vmax``, else ``vhat = v``;
   ``d = sqrt32(vhat) * f32(1 / sqrt(1 - b2^t)) + f32(eps)``;
   ``p = p - div32(m, d) * f32(lr / (1 - b1^t))``.

   AdamW (and Adam with ``decoupled_weight_decay``): as Adam, but weight decay is
   ``p = p * f32(1 - lr * wd)`` first, and ``g`` is not decayed.

   SGD: ``g = g + p * f32(wd)``; with momentum ``mu``: ``buf = g`` on the first step
   (the buffer is None), else ``buf = buf * f32(mu) + g * f32(1 - dampening)``; then
   ``g = g + buf * f32(mu)`` (nesterov) or ``g = buf``; ``p = p - g * f32(lr)``.

   RMSprop: ``g = g + p * f32(wd)``; ``s = s * f32(alpha) + (g * g) * f32(1 - alpha)``;
   centered: ``ga = ga * f32(alpha) + g * f32(1 - alpha)``,
   ``d = sqrt32(s - ga * ga) + f32(eps)``, else ``d = sqrt32(s) + f32(eps)``; with
   momentum ``buf = buf * f32(mu) + div32(g, d)``, ``p = p - buf * f32(lr)``; without,
   ``p = p - div32(g, d) * f32(lr)``.

   Adagrad: ``g = g + p * f32(wd)``; ``sum = sum + g * g``;
   ``p = p - div32(g, sqrt32(sum) + f32(eps)) * f32(lr / (1 + (t - 1) * lr_decay))``.

   Adamax: ``g = g + p * f32(wd)``; ``m = m * f32(b1) + g * f32(1 - b1)``;
   ``u = maximum(u * f32(b2), abs(g) + f32(eps))``;
   ``p = p - div32(m, u) * f32(lr / (1 - b1^t))``.

   NAdam: weight decay as Adam (or AdamW with ``decoupled_weight_decay``);
   ``mu = b1 * (1 - 0.5 * 0.96^(t * psi))``, ``mu' = b1 * (1 - 0.5 * 0.96^((t + 1) * psi))``
   (``psi = momentum_decay``); the state ``mu_product`` becomes
   ``P = f32(mu_product * f32(mu))`` (a float32 product, as torch's);
   ``m`` and ``v`` as Adam; ``d = sqrt32(v * f32(1 / (1 - b2^t))) + f32(eps)``;
   ``p = p - div32(g, d) * f32(lr * (1 - mu) / (1 - P))``;
   ``p = p - div32(m, d) * f32(lr * mu' / (1 - P * mu'))``.

   RAdam: weight decay as NAdam; ``m`` and ``v`` as Adam;
   ``rho_inf = 2 / (1 - b2) - 1``; ``rho = rho_inf - 2 * t * b2^t / (1 - b2^t)``; when
   ``rho > 5``: ``r = sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))``
   and ``p = p - div32(m, sqrt32(v) + f32(eps)) * f32(lr * r * sqrt(1 - b2^t) / (1 - b1^t))``;
   otherwise ``p = p - m * f32(lr / (1 - b1^t))``.

Why the bits agree across CPU kernel families, thread counts and GPUs: every tensor
operation above is one elementwise kernel, so no compiler can contract a multiply and
an add of two operations into a fused multiply-add; ``a + b`` and ``a - b`` are
``a + alpha * b`` with ``alpha = +-1`` inside Torch, exact even where that is compiled
to a fused multiply-add; a scalar operand is float32-representable, so converting it
to the kernel's float32 changes nothing; there is no division by a Python number
(CUDA computes it as a multiplication by the reciprocal); float64 division and square
root are IEEE on CUDA and within one float64 ulp on CPU, which the float32 rounding
absorbs (see :func:`_div32`); float conversions round to nearest even everywhere;
elementwise kernels split work between threads without changing any element's
operations. Tests check it bitwise across ``ATEN_CPU_CAPABILITY`` and thread counts.

Options that only select an implementation (``foreach``, ``fused``, ``capturable``,
``differentiable=False``) are ignored. Parameters whose gradient is None are skipped,
as ``torch.optim`` skips them. Preconditions: the update runs eagerly (under
``torch.compile`` a fused kernel may contract ``a * b + c`` into a fused multiply-add)
and subnormal numbers are not flushed to zero (``torch.set_flush_denormal(False)``,
Torch's default).
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import cache, partial
from typing import Any

import torch

__all__ = ["CANONICAL_VERSION", "supports", "update"]

#: The name of the arithmetic this module defines; a change of any rounding is a new name.
CANONICAL_VERSION = "zkdv-torch-canonical-v1"

UNSUPPORTED_OPTIMIZER = (
    f"{CANONICAL_VERSION} has no canonical update for torch.optim.{{name}}; it covers {{supported}}"
)
UNSUPPORTED_DTYPE = (
    f"{CANONICAL_VERSION} computes in float32 and supports float32, bfloat16 and float16 "
    "tensors, not {dtype}"
)
UNSUPPORTED_DIFFERENTIABLE = "a differentiable optimizer step has no canonical update"
UNSUPPORTED_SPARSE = f"{CANONICAL_VERSION} has no canonical update for sparse gradients"
UNSUPPORTED_TENSOR_OPTIONS = (
    "the canonical update computes its scalars on the host, but the options {names} are tensors"
)
UNSUPPORTED_OPTION = "the canonical update needs option {name} as a finite number, got {value!r}"
COMPILED = (
    "the canonical optimizer update must run eagerly: a compiled kernel may contract "
    "a * b + c into a fused multiply-add"
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# torch.optim's 0.96 in NAdam's momentum schedule (Dozat 2016, section 3).
_MOMENTUM_BASE = 0.96

State = dict[str, Any]
Group = dict[str, Any]


# --- host scalars (Python float64) -------------------------------------------------------
def _f32(value: float) -> float:
    """``value`` rounded once to the nearest float32 (ties to even), as a Python float.

    ``struct`` converts with a C ``(float)`` cast: IEEE-754 round to nearest even.
    """
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _power(base: float, exponent: int) -> float:
    """``base ** exponent`` for an integer ``exponent >= 0``, by square-and-multiply.

    Walks the exponent's bits from the least significant: where a bit is set the
    result is multiplied by the current square, then the square is squared. Every
    step is one float64 multiplication, so the value is the same everywhere, where
    ``**`` calls the C library's ``pow`` (not correctly rounded; glibc, musl and
    macOS differ in the last bit).
    """
    result = 1.0
    square = base
    while exponent:
        if exponent & 1:
            result = result * square
        square = square * square
        exponent >>= 1
    return result


_LN2 = 0.6931471805599453  # the float64 nearest ln 2
_SQRT_HALF = 0.7071067811865476  # the float64 nearest sqrt(1/2)
_LOG_TERMS = 12  # terms k = 0..12; |s| <= 0.1716, so the next is below 1e-20
_EXP_TERMS = 18  # terms n = 0..18; |r| <= 0.347, so the next is below 1e-25


def _log(value: float) -> float:
    """Natural logarithm of ``value > 0`` from ``+ - * /`` alone (no libm).

    ``value = m * 2**e`` with ``m`` in ``[sqrt(1/2), sqrt(2))`` (exact), then
    ``ln m = 2 atanh(s) = 2 s sum_k s**(2k) / (2k + 1)`` with ``s = (m - 1) / (m + 1)``,
    summed in Horner form, and ``ln value = ln m + e ln 2``. A few float64 ulps off
    ``ln``; what matters is that it is the same function on every machine.
    """
    mantissa, exponent = math.frexp(value)
    if mantissa < _SQRT_HALF:
        mantissa = mantissa * 2.0
        exponent -= 1
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    series = 0.0
    for k in range(_LOG_TERMS, -1, -1):
        series = series * s2 + 1.0 / (2 * k + 1)
    return 2.0 * s * series + exponent * _LN2


def _exp(value: float) -> float:
    """``e ** value`` from ``+ - * /`` alone: ``2**k * e**r`` with ``|r| <= ln(2) / 2``.

    ``e**r`` is its Taylor series in Horner form; ``round`` and ``math.ldexp`` are exact.
    """
    k = round(value / _LN2)
    r = value - k * _LN2
    series = 1.0
    for n in range(_EXP_TERMS, 0, -1):
        series = 1.0 + series * r / n
    return math.ldexp(series, k)


def _real_power(base: float, exponent: float) -> float:
    """``base ** exponent`` for ``base > 0`` and a real exponent, without libm."""
    if exponent == 0:
        return 1.0
    return _exp(exponent * _log(base))


def _betas(group: Group) -> tuple[float, float]:
    beta1, beta2 = group["betas"]
    return float(beta1), float(beta2)


# --- tensor operations (float32, each correctly rounded) --------------------------------
def _div32(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 quotient of two float32 tensors.

    Why float64: a float32 division is not IEEE everywhere (Triton's default and CUDA
    fast-math divide approximately; some kernels multiply by a reciprocal). The quotient
    of two float32 numbers is never closer than about 2**-49 (relative) to a midpoint
    between two float32 neighbours, so any float64 quotient within a few float64 ulps
    (2**-52) of the true one, correctly rounded or not, rounds to the same float32.
    """
    return (numerator.double() / denominator.double()).float()


def _sqrt32(value: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of a float32 tensor.

    Why float64: Torch's CPU ``sqrt`` is not correctly rounded (about 17% of float32
    results are one ulp off, 1% of float64 results). A float32 square root is never
    within 2**-50 (relative) of a float32 rounding midpoint, and the float64 square
    root errs by at most one float64 ulp (2**-52), so rounding it to float32 gives the
    correctly rounded result on every device.
    """
    return value.double().sqrt().float()


def _store(target: torch.Tensor, value: torch.Tensor) -> None:
    """Write a float32 result into ``target``: rounded once to its dtype, NaNs canonical.

    IEEE-754 leaves a NaN's sign and payload to the implementation, and they differ:
    ``sqrt`` of a negative number is a negative NaN on x86, and Torch's CPU conversion
    of a float32 NaN to bfloat16 gives 0x7FC0 in its scalar kernel but 0xFFFF in its
    AVX2 and AVX-512 kernels. Every NaN is stored as the one positive quiet NaN with
    a zero payload, so a NaN in the state hashes the same everywhere.
    """
    rounded = value.to(target.dtype)
    rounded = torch.where(
        torch.isnan(rounded), _canonical_nan(target.dtype, target.device), rounded
    )
    target.copy_(rounded)


_NAN_BITS = {
    torch.float32: (torch.int32, 0x7FC00000),
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float16: (torch.int16, 0x7E00),
}


@cache
def _canonical_nan(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The canonical quiet NaN of ``dtype``, from its bits: a conversion could change them."""
    integer, bits = _NAN_BITS[dtype]
    return torch.tensor(bits, dtype=integer).view(dtype).to(device)


def _advance(state: State) -> int:
    """Increment ``state["step"]`` in place, as torch.optim does, and return it as ``t``.

    Raises:
        ValueError: the step is not a whole positive number.
    """
    step = state["step"]
    step += 1  # in place: the tensor keeps its dtype and device
    value = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
    if not value.is_integer() or value < 1:
        raise ValueError(f"optimizer state step={value!r} is not a whole number of steps")
    state["step"] = step
    return int(value)


def _maximized(gradient: torch.Tensor, group: Group) -> torch.Tensor:
    g = gradient.float()
    if group.get("maximize", False):
        g = torch.neg(g)
    return g


def _coupled_decay(g: torch.Tensor, p: torch.Tensor, weight_decay: float) -> torch.Tensor:
    decay = p * _f32(weight_decay)
    return g + decay


def _moments(
    g: torch.Tensor, state: State, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's first and second moments: ``m * b1 + g * (1 - b1)``, ``v * b2 + g*g * (1 - b2)``."""
    m = state["exp_avg"].float() * _f32(beta1)
    new = g * _f32(1.0 - beta1)
    m = m + new
    v = state["exp_avg_sq"].float() * _f32(beta2)
    square = g * g
    square = square * _f32(1.0 - beta2)
    v = v + square
    return m, v


# --- optimizers (one parameter each) ------------------------------------------------------
def _adam(
    parameter: torch.Tensor,
    gradient: torch.Tensor,
    state: State,
    group: Group,
    *,
    decoupled: bool,
) -> None:
    """Adam (Kingma and Ba 2015, algorithm 1); AdamW (Loshchilov and Hutter 2019)."""
    beta1, beta2 = _betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    amsgrad = bool(group.get("amsgrad", False))
    t = _advance(state)
    step_size = _f32(lr / (1.0 - _power(beta1, t)))
    inverse_root_correction = _f32(1.0 / math.sqrt(1.0 - _power(beta2, t)))

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        if decoupled:
            p = p * _f32(1.0 - lr * weight_decay)
        else:
            g = _coupled_decay(g, p, weight_decay)
    m, v = _moments(g, state, beta1, beta2)
    vhat = v
    if amsgrad:
        vhat = torch.maximum(state["max_exp_avg_sq"].float(), v)
    denominator = _sqrt32(vhat)
    denominator = denominator * inverse_root_correction
    denominator = denominator + _f32(float(group["eps"]))
    delta = _div32(m, denominator)
    delta = delta * step_size
    p = p - delta

    _store(parameter, p)
    _store(state["exp_avg"], m)
    _store(state["exp_avg_sq"], v)
    if amsgrad:
        _store(state["max_exp_avg_sq"], vhat)


def _sgd(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """SGD with momentum (Sutskever et al. 2013), torch.optim's formulation."""
    weight_decay = float(group["weight_decay"])
    momentum = float(group["momentum"])

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        g = _coupled_decay(g, p, weight_decay)
    buffer = None
    if momentum != 0:
        previous = state.get("momentum_buffer")
        if previous is None:
            # torch.optim starts the buffer as a copy of the gradient, not from zeros.
            buffer = g
        else:
            buffer = previous.float() * _f32(momentum)
            new = g * _f32(1.0 - float(group["dampening"]))
            buffer = buffer + new
        if group.get("nesterov", False):
            look_ahead = buffer * _f32(momentum)
            g = g + look_ahead
        else:
            g = buffer
    delta = g * _f32(float(group["lr"]))
    p = p - delta

    _store(parameter, p)
    if buffer is not None:
        if state.get("momentum_buffer") is None:
            # torch.optim's clone of the (decayed) gradient: its dtype and layout.
            dtype = gradient.dtype
            if weight_decay != 0:
                dtype = torch.promote_types(dtype, parameter.dtype)
            state["momentum_buffer"] = torch.empty_like(gradient, dtype=dtype)
        _store(state["momentum_buffer"], buffer)


def _rmsprop(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """RMSprop (Hinton, lecture 6e; centered: Graves 2013, equations 38-45)."""
    alpha = float(group["alpha"])
    weight_decay = float(group["weight_decay"])
    momentum = float(group["momentum"])
    centered = bool(group.get("centered", False))
    _advance(state)

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        g = _coupled_decay(g, p, weight_decay)
    square_avg = state["square_avg"].float() * _f32(alpha)
    square = g * g
    square = square * _f32(1.0 - alpha)
    square_avg = square_avg + square
    grad_avg = None
    if centered:
        grad_avg = state["grad_avg"].float() * _f32(alpha)
        new = g * _f32(1.0 - alpha)
        grad_avg = grad_avg + new
        mean_square = grad_avg * grad_avg
        variance = square_avg - mean_square
        denominator = _sqrt32(variance)
    else:
        denominator = _sqrt32(square_avg)
    denominator = denominator + _f32(float(group["eps"]))
    ratio = _div32(g, denominator)
    lr = _f32(float(group["lr"]))
    buffer = None
    if momentum > 0:
        buffer = state["momentum_buffer"].float() * _f32(momentum)
        buffer = buffer + ratio
        delta = buffer * lr
    else:
        delta = ratio * lr
    p = p - delta

    _store(parameter, p)
    _store(state["square_avg"], square_avg)
    if grad_avg is not None:
        _store(state["grad_avg"], grad_avg)
    if buffer is not None:
        _store(state["momentum_buffer"], buffer)


def _adagrad(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """Adagrad (Duchi et al. 2011, figure 1, diagonal form)."""
    weight_decay = float(group["weight_decay"])
    t = _advance(state)
    step_size = _f32(float(group["lr"]) / (1.0 + (t - 1) * float(group["lr_decay"])))

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        g = _coupled_decay(g, p, weight_decay)
    square = g * g
    total = state["sum"].float() + square
    denominator = _sqrt32(total)
    denominator = denominator + _f32(float(group["eps"]))
    delta = _div32(g, denominator)
    delta = delta * step_size
    p = p - delta

    _store(parameter, p)
    _store(state["sum"], total)


def _adamax(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """Adamax (Kingma and Ba 2015, algorithm 2)."""
    beta1, beta2 = _betas(group)
    weight_decay = float(group["weight_decay"])
    t = _advance(state)
    step_size = _f32(float(group["lr"]) / (1.0 - _power(beta1, t)))

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        g = _coupled_decay(g, p, weight_decay)
    m = state["exp_avg"].float() * _f32(beta1)
    new = g * _f32(1.0 - beta1)
    m = m + new
    norm = state["exp_inf"].float() * _f32(beta2)
    magnitude = torch.abs(g)
    magnitude = magnitude + _f32(float(group["eps"]))
    norm = torch.maximum(norm, magnitude)
    delta = _div32(m, norm)
    delta = delta * step_size
    p = p - delta

    _store(parameter, p)
    _store(state["exp_avg"], m)
    _store(state["exp_inf"], norm)


def _nadam(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """NAdam (Dozat 2016, algorithm 2, with torch.optim's momentum schedule)."""
    beta1, beta2 = _betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    momentum_decay = float(group["momentum_decay"])
    t = _advance(state)
    mu = beta1 * (1.0 - 0.5 * _real_power(_MOMENTUM_BASE, t * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * _real_power(_MOMENTUM_BASE, (t + 1) * momentum_decay))
    # torch.optim keeps the product as a float32 tensor: a float32 multiplication (the
    # float64 product of two float32 numbers is exact, so one rounding to float32).
    mu_product = _f32(_f32(float(state["mu_product"].item())) * _f32(mu))
    mu_product_next = mu_product * mu_next
    gradient_size = _f32(lr * (1.0 - mu) / (1.0 - mu_product))
    average_size = _f32(lr * mu_next / (1.0 - mu_product_next))
    inverse_correction = _f32(1.0 / (1.0 - _power(beta2, t)))

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", False):
            p = p * _f32(1.0 - lr * weight_decay)
        else:
            g = _coupled_decay(g, p, weight_decay)
    m, v = _moments(g, state, beta1, beta2)
    denominator = v * inverse_correction
    denominator = _sqrt32(denominator)
    denominator = denominator + _f32(float(group["eps"]))
    delta = _div32(g, denominator)
    delta = delta * gradient_size
    p = p - delta
    delta = _div32(m, denominator)
    delta = delta * average_size
    p = p - delta

    _store(parameter, p)
    _store(state["exp_avg"], m)
    _store(state["exp_avg_sq"], v)
    state["mu_product"].fill_(mu_product)


def _radam(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """RAdam (Liu et al. 2020, algorithm 2)."""
    beta1, beta2 = _betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    t = _advance(state)
    correction1 = 1.0 - _power(beta1, t)
    beta2_t = _power(beta2, t)
    correction2 = 1.0 - beta2_t
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho = rho_inf - 2.0 * t * beta2_t / correction2

    p = parameter.float()
    g = _maximized(gradient, group)
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", False):
            p = p * _f32(1.0 - lr * weight_decay)
        else:
            g = _coupled_decay(g, p, weight_decay)
    m, v = _moments(g, state, beta1, beta2)
    if rho > 5.0:  # the adaptive step's variance is tractable (torch.optim's threshold)
        rectification = math.sqrt(
            (rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho)
        )
        step_size = _f32(lr * rectification * math.sqrt(correction2) / correction1)
        denominator = _sqrt32(v)
        denominator = denominator + _f32(float(group["eps"]))
        delta = _div32(m, denominator)
        delta = delta * step_size
    else:  # an un-adapted momentum step
        delta = m * _f32(lr / correction1)
    p = p - delta

    _store(parameter, p)
    _store(state["exp_avg"], m)
    _store(state["exp_avg_sq"], v)


_Update = Callable[[torch.Tensor, torch.Tensor, State, Group], None]

_UPDATES: dict[str, _Update] = {
    "Adam": partial(_adam, decoupled=False),
    "AdamW": partial(_adam, decoupled=True),
    "SGD": _sgd,
    "RMSprop": _rmsprop,
    "Adagrad": _adagrad,
    "Adamax": _adamax,
    "NAdam": _nadam,
    "RAdam": _radam,
}

# The numeric options each update reads (betas: a pair).
_ADAM_OPTIONS = ("lr", "betas", "eps", "weight_decay")
_OPTIONS: dict[str, tuple[str, ...]] = {
    "Adam": _ADAM_OPTIONS,
    "AdamW": _ADAM_OPTIONS,
    "SGD": ("lr", "momentum", "dampening", "weight_decay"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum"),
    "Adagrad": ("lr", "lr_decay", "eps", "weight_decay"),
    "Adamax": _ADAM_OPTIONS,
    "NAdam": (*_ADAM_OPTIONS, "momentum_decay"),
    "RAdam": _ADAM_OPTIONS,
}


# --- public API ---------------------------------------------------------------------------
def supports(
    optimizer_name: str, group: dict[str, Any], dtypes: Iterable[torch.dtype]
) -> str | None:
    """Whether the canonical update covers one parameter group.

    Sparse gradients cannot be seen here; :func:`update` refuses them.

    Args:
        optimizer_name: the ``torch.optim`` class name (``"Adam"``, ``"SGD"``, ...).
        group: the parameter group's options, as ``torch.optim`` keeps them.
        dtypes: the dtypes of the group's parameters.

    Returns:
        None when the canonical update covers the group, else the reason it does not
        (a sentence).
    """
    if optimizer_name not in _UPDATES:
        return UNSUPPORTED_OPTIMIZER.format(name=optimizer_name, supported=", ".join(_UPDATES))
    if group.get("differentiable", False):
        return UNSUPPORTED_DIFFERENTIABLE
    tensors = sorted(
        name for name, value in group.items() if name != "params" and _holds_tensor(value)
    )
    if tensors:
        return UNSUPPORTED_TENSOR_OPTIONS.format(names=tensors)
    for name in _OPTIONS[optimizer_name]:
        value = group.get(name)
        values = value if name == "betas" and isinstance(value, (tuple, list)) else (value,)
        if (name == "betas" and len(values) != 2) or not all(_finite(v) for v in values):
            return UNSUPPORTED_OPTION.format(name=name, value=value)
    for dtype in dtypes:
        if dtype not in _DTYPES:
            return UNSUPPORTED_DTYPE.format(dtype=dtype)
    return None


def update(
    optimizer_name: str,
    parameters: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor | None],
    states: Sequence[dict[str, Any]],
    group: dict[str, Any],
) -> None:
    """Apply one parameter group's canonical update in place.

    Each parameter, and each entry of its state, is overwritten with the value the
    canonical update computes (state tensors in place, so views into shared buffers
    stay valid); SGD's absent momentum buffer is created on its first step, as
    ``torch.optim`` does.

    Args:
        optimizer_name: the ``torch.optim`` class name (``"Adam"``, ``"AdamW"``,
            ``"SGD"``, ...).
        parameters: the group's parameters.
        gradients: their gradients, in the same order; a None gradient skips its
            parameter (its state is left unchanged, ``step`` included).
        states: their state dictionaries in ``torch.optim``'s layout (Adam: ``step``,
            ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``; SGD:
            ``momentum_buffer``, None before the first step).
        group: the group's options, as ``torch.optim`` keeps them (``lr``, ``betas``,
            ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``, ``momentum``,
            ``dampening``, ``nesterov``, ``decoupled_weight_decay``, ...).

    Raises:
        ValueError: :func:`supports` refuses the group, or a tensor is sparse or of a
            dtype the canonical update does not cover.
        RuntimeError: called while ``torch.compile`` traces.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(COMPILED)
    reason = supports(optimizer_name, group, ())
    if reason is not None:
        raise ValueError(reason)
    apply = _UPDATES[optimizer_name]
    with torch.no_grad():
        active = []
        for parameter, gradient, state in zip(parameters, gradients, states, strict=True):
            if gradient is None:
                continue
            _check(parameter, gradient, state)
            active.append((parameter, gradient, state))
        for parameter, gradient, state in active:
            if optimizer_name in ("Adam", "AdamW") and _adam_in_place(
                parameter, gradient, state, group, decoupled=optimizer_name == "AdamW"
            ):
                continue
            apply(parameter, gradient, state, group)


#: Elements per chunk of the in-place Adam path, which bounds its scratch (two float32
#: and two float64 vectors of this size): large, since every chunk costs about twenty
#: operator calls (measured on two CPU cores: whole 10M-element tensors 113 ms, 256K
#: chunks 150 ms, 64K chunks 172 ms).
CHUNK_ELEMENTS = {"cpu": 1 << 22}
DEVICE_CHUNK_ELEMENTS = 1 << 24
_scratch = threading.local()


def _buffers(device: torch.device, size: int) -> tuple[torch.Tensor, ...]:
    """This thread's scratch on ``device``: two float32 and two float64 vectors of ``size``.

    Reused across steps (a fresh allocation of a large CPU tensor costs page faults that
    outweigh the arithmetic) and per thread (training and the SDK's check update at once).
    """
    cache: dict[torch.device, tuple[torch.Tensor, ...]] = _scratch.__dict__.setdefault("by", {})
    held = cache.get(device)
    if held is None or held[0].numel() < size:
        held = (
            torch.empty(size, dtype=torch.float32, device=device),
            torch.empty(size, dtype=torch.float32, device=device),
            torch.empty(size, dtype=torch.float64, device=device),
            torch.empty(size, dtype=torch.float64, device=device),
        )
        cache[device] = held
    return tuple(buffer[:size] for buffer in held)


@cache
def _ieee_division(device: torch.device) -> bool:
    """Whether this device's float32 tensor division is correctly rounded, as div32 is.

    Torch's CPU kernels divide with the instruction set's IEEE division (``divps``), on
    every kernel family; the in-place Adam path then divides in float32, which is
    :func:`_div32`'s result with a quarter of the memory traffic. Checked once per
    process on a million random quotients and the edge cases (subnormal, tiny and huge
    magnitudes), against the float64 route; any other device takes the float64 route.
    """
    if device.type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    numerators = torch.randn(1 << 20, generator=generator)
    denominators = torch.randn(1 << 20, generator=generator)
    exponents = torch.randint(-140, 120, (1 << 20,), generator=generator).float()
    numerators = numerators * torch.exp2(exponents)
    edges = torch.tensor([1e-45, 1.17549435e-38, 3.4e38, 1.0, 3.0, 7.0, 0.1], dtype=torch.float32)
    numerators = torch.cat([numerators, edges, edges])
    denominators = torch.cat([denominators, edges.flip(0), edges])
    return bool(torch.equal(numerators / denominators, _div32(numerators, denominators)))


def _adam_in_place(
    parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group, *, decoupled: bool
) -> bool:
    """:func:`_adam` computed in place, chunk by chunk, on preallocated scratch.

    The same operations in the same order on every element, so the same bits (tested
    against :func:`_adam`): an element's result does not depend on which chunk it is in,
    and an in-place or ``out=`` operation rounds as its out-of-place form does. It avoids
    :func:`_adam`'s dozen fresh tensors the size of the parameter per step, which on a CPU
    cost more than the arithmetic. Covers float32 tensors that are all contiguous;
    returns False (nothing done) otherwise, and :func:`_adam` updates the parameter.
    """
    amsgrad = bool(group.get("amsgrad", False))
    tensors = [parameter, gradient, state["exp_avg"], state["exp_avg_sq"]]
    if amsgrad:
        tensors.append(state["max_exp_avg_sq"])
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    beta1, beta2 = _betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    maximize = bool(group.get("maximize", False))
    t = _advance(state)
    step_size = _f32(lr / (1.0 - _power(beta1, t)))
    inverse_root_correction = _f32(1.0 / math.sqrt(1.0 - _power(beta2, t)))
    eps = _f32(float(group["eps"]))
    flat = [tensor.view(-1) for tensor in tensors]
    p, g, m, v = flat[:4]
    vmax = flat[4] if amsgrad else None
    total = p.numel()
    chunk = CHUNK_ELEMENTS.get(p.device.type, DEVICE_CHUNK_ELEMENTS)
    a32, b32, a64, b64 = _buffers(p.device, min(chunk, max(total, 1)))
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        n = stop - start
        pc, mc, vc = p[start:stop], m[start:stop], v[start:stop]
        ga, gb, fa, fb = a32[:n], b32[:n], a64[:n], b64[:n]
        gc = g[start:stop]
        if maximize or (weight_decay != 0 and not decoupled):
            ga.copy_(gc)
            if maximize:
                ga.neg_()
            if weight_decay != 0 and not decoupled:
                torch.mul(pc, _f32(weight_decay), out=gb)
                ga.add_(gb)
            gc = ga
        if weight_decay != 0 and decoupled:
            pc.mul_(_f32(1.0 - lr * weight_decay))
        mc.mul_(_f32(beta1))
        torch.mul(gc, _f32(1.0 - beta1), out=gb)
        mc.add_(gb)
        torch.mul(gc, gc, out=gb)
        gb.mul_(_f32(1.0 - beta2))
        vc.mul_(_f32(beta2))
        vc.add_(gb)
        vhat = vc
        if vmax is not None:
            vhat = vmax[start:stop]
            torch.maximum(vhat, vc, out=vhat)
        fa.copy_(vhat)  # sqrt32: through float64
        fa.sqrt_()
        gb.copy_(fa)
        gb.mul_(inverse_root_correction)
        gb.add_(eps)
        if _ieee_division(pc.device):
            torch.div(mc, gb, out=gb)  # div32: the device divides float32 correctly
        else:
            fa.copy_(mc)  # div32: through float64
            fb.copy_(gb)
            fa.div_(fb)
            gb.copy_(fa)
        gb.mul_(step_size)
        pc.sub_(gb)
    # A NaN anywhere in the moments reaches the parameter (through the quotient), so on
    # a CPU the parameter's sum tells whether any NaN must be made canonical: one read, no
    # copy. On an accelerator reading it would wait for the device: always canonical.
    if p.device.type != "cpu" or bool(torch.isnan(p.sum())):
        _canonical_nans(tensors[:1] + tensors[2:])
    return True


def _canonical_nans(tensors: list[torch.Tensor]) -> None:
    """:func:`_store`'s NaN rule, in place, for float32 tensors updated in place."""
    for tensor in tensors:
        tensor.masked_fill_(torch.isnan(tensor), _canonical_nan(torch.float32, tensor.device))


def _check(parameter: torch.Tensor, gradient: torch.Tensor, state: State) -> None:
    if gradient.is_sparse:
        raise ValueError(UNSUPPORTED_SPARSE)
    tensors = [parameter, gradient] + [
        value for name, value in state.items() if name not in ("step", "mu_product")
    ]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in _DTYPES:
            raise ValueError(UNSUPPORTED_DTYPE.format(dtype=tensor.dtype))


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
