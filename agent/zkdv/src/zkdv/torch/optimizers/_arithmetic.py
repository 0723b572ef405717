"""The arithmetic of zkdv-torch-canonical-v1 (:mod:`zkdv.torch.optimizers.canonical`).

Host scalars are Python float64, each operation correctly rounded, then rounded once to
float32 (:func:`f32`); powers and NAdam's real power are built from ``+ - * /`` alone, so
no C library's ``pow``, ``log`` or ``exp`` enters. Tensor division and square root go
through float64 and round once to float32 (:func:`div32`, :func:`sqrt32`); a result is
stored in its tensor's dtype with one canonical NaN (:func:`store`). The remaining
helpers are the steps the formulas share: the step count, ``maximize``, coupled weight
decay and Adam's moments.
"""

from __future__ import annotations

import math
import struct
from functools import cache
from typing import Any

import torch

__all__ = [
    "Group",
    "State",
    "advance",
    "betas",
    "canonical_nan",
    "coupled_decay",
    "div32",
    "f32",
    "maximized",
    "moments",
    "power",
    "real_power",
    "sqrt32",
    "store",
]

State = dict[str, Any]
Group = dict[str, Any]


# --- host scalars (Python float64) -------------------------------------------------------
def f32(value: float) -> float:
    """``value`` rounded once to the nearest float32 (ties to even), as a Python float.

    ``struct`` converts with a C ``(float)`` cast: IEEE-754 round to nearest even.
    """
    return float(struct.unpack("f", struct.pack("f", value))[0])


def power(base: float, exponent: int) -> float:
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


def real_power(base: float, exponent: float) -> float:
    """``base ** exponent`` for ``base > 0`` and a real exponent, without libm."""
    if exponent == 0:
        return 1.0
    return _exp(exponent * _log(base))


def betas(group: Group) -> tuple[float, float]:
    beta1, beta2 = group["betas"]
    return float(beta1), float(beta2)


# --- tensor operations (float32, each correctly rounded) --------------------------------
def div32(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 quotient of two float32 tensors.

    Why float64: a float32 division is not IEEE everywhere (Triton's default and CUDA
    fast-math divide approximately; some kernels multiply by a reciprocal). The quotient
    of two float32 numbers is never closer than about 2**-49 (relative) to a midpoint
    between two float32 neighbours, so any float64 quotient within a few float64 ulps
    (2**-52) of the true one, correctly rounded or not, rounds to the same float32.
    """
    return (numerator.double() / denominator.double()).float()


def sqrt32(value: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of a float32 tensor.

    Why float64: Torch's CPU ``sqrt`` is not correctly rounded (about 17% of float32
    results are one ulp off, 1% of float64 results). A float32 square root is never
    within 2**-50 (relative) of a float32 rounding midpoint, and the float64 square
    root errs by at most one float64 ulp (2**-52), so rounding it to float32 gives the
    correctly rounded result on every device. On a CPU that holds once MKL's vector
    math is initialised on one thread (:mod:`zkdv.torch._vml`, at import): the first
    call of a fresh process, raced by two threads, was off by 2**18 ulps.
    """
    return value.double().sqrt().float()


def store(target: torch.Tensor, value: torch.Tensor) -> None:
    """Write a float32 result into ``target``: rounded once to its dtype, NaNs canonical.

    IEEE-754 leaves a NaN's sign and payload to the implementation, and they differ:
    ``sqrt`` of a negative number is a negative NaN on x86, and Torch's CPU conversion
    of a float32 NaN to bfloat16 gives 0x7FC0 in its scalar kernel but 0xFFFF in its
    AVX2 and AVX-512 kernels. Every NaN is stored as the one positive quiet NaN with
    a zero payload, so a NaN in the state hashes the same everywhere.
    """
    rounded = value.to(target.dtype)
    rounded = torch.where(torch.isnan(rounded), canonical_nan(target.dtype, target.device), rounded)
    target.copy_(rounded)


_NAN_BITS = {
    torch.float32: (torch.int32, 0x7FC00000),
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float16: (torch.int16, 0x7E00),
}


@cache
def canonical_nan(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The canonical quiet NaN of ``dtype``, from its bits: a conversion could change them."""
    integer, bits = _NAN_BITS[dtype]
    return torch.tensor(bits, dtype=integer).view(dtype).to(device)


def advance(state: State) -> int:
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


def maximized(gradient: torch.Tensor, group: Group) -> torch.Tensor:
    g = gradient.float()
    if group.get("maximize", False):
        g = torch.neg(g)
    return g


def coupled_decay(g: torch.Tensor, p: torch.Tensor, weight_decay: float) -> torch.Tensor:
    decay = p * f32(weight_decay)
    return g + decay


def moments(
    g: torch.Tensor, state: State, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's first and second moments: ``m * b1 + g * (1 - b1)``, ``v * b2 + g*g * (1 - b2)``."""
    m = state["exp_avg"].float() * f32(beta1)
    new = g * f32(1.0 - beta1)
    m = m + new
    v = state["exp_avg_sq"].float() * f32(beta2)
    square = g * g
    square = square * f32(1.0 - beta2)
    v = v + square
    return m, v
