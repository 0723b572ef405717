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
   even). Integer powers ``beta^t`` are :func:`power` (square-and-multiply), not
   ``**`` (libm ``pow`` is not correctly rounded and differs across C libraries);
   square roots are ``math.sqrt`` (correctly rounded); NAdam's real power ``0.96^x``
   is :func:`real_power`, built from ``+ - * /`` only. ``t`` is the parameter's
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
root are IEEE on CUDA and within one float64 ulp on CPU (MKL's vector math initialised
on one thread, :mod:`zkdv.torch._vml`), which the float32 rounding absorbs (see
:func:`div32`); float conversions round to nearest even everywhere;
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
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from zkdv.torch.optimizers._adam_inplace import adam_in_place_all
from zkdv.torch.optimizers._arithmetic import (
    Group,
    State,
    advance,
    betas,
    coupled_decay,
    div32,
    f32,
    maximized,
    moments,
    power,
    real_power,
    sqrt32,
    store,
)

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
    beta1, beta2 = betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    amsgrad = bool(group.get("amsgrad", False))
    t = advance(state)
    step_size = f32(lr / (1.0 - power(beta1, t)))
    inverse_root_correction = f32(1.0 / math.sqrt(1.0 - power(beta2, t)))

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        if decoupled:
            p = p * f32(1.0 - lr * weight_decay)
        else:
            g = coupled_decay(g, p, weight_decay)
    m, v = moments(g, state, beta1, beta2)
    vhat = v
    if amsgrad:
        vhat = torch.maximum(state["max_exp_avg_sq"].float(), v)
    denominator = sqrt32(vhat)
    denominator = denominator * inverse_root_correction
    denominator = denominator + f32(float(group["eps"]))
    delta = div32(m, denominator)
    delta = delta * step_size
    p = p - delta

    store(parameter, p)
    store(state["exp_avg"], m)
    store(state["exp_avg_sq"], v)
    if amsgrad:
        store(state["max_exp_avg_sq"], vhat)


def _sgd(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """SGD with momentum (Sutskever et al. 2013), torch.optim's formulation."""
    weight_decay = float(group["weight_decay"])
    momentum = float(group["momentum"])

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        g = coupled_decay(g, p, weight_decay)
    buffer = None
    if momentum != 0:
        previous = state.get("momentum_buffer")
        if previous is None:
            # torch.optim starts the buffer as a copy of the gradient, not from zeros.
            buffer = g
        else:
            buffer = previous.float() * f32(momentum)
            new = g * f32(1.0 - float(group["dampening"]))
            buffer = buffer + new
        if group.get("nesterov", False):
            look_ahead = buffer * f32(momentum)
            g = g + look_ahead
        else:
            g = buffer
    delta = g * f32(float(group["lr"]))
    p = p - delta

    store(parameter, p)
    if buffer is not None:
        if state.get("momentum_buffer") is None:
            # torch.optim's clone of the (decayed) gradient: its dtype and layout.
            dtype = gradient.dtype
            if weight_decay != 0:
                dtype = torch.promote_types(dtype, parameter.dtype)
            state["momentum_buffer"] = torch.empty_like(gradient, dtype=dtype)
        store(state["momentum_buffer"], buffer)


def _rmsprop(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """RMSprop (Hinton, lecture 6e; centered: Graves 2013, equations 38-45)."""
    alpha = float(group["alpha"])
    weight_decay = float(group["weight_decay"])
    momentum = float(group["momentum"])
    centered = bool(group.get("centered", False))
    advance(state)

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        g = coupled_decay(g, p, weight_decay)
    square_avg = state["square_avg"].float() * f32(alpha)
    square = g * g
    square = square * f32(1.0 - alpha)
    square_avg = square_avg + square
    grad_avg = None
    if centered:
        grad_avg = state["grad_avg"].float() * f32(alpha)
        new = g * f32(1.0 - alpha)
        grad_avg = grad_avg + new
        mean_square = grad_avg * grad_avg
        variance = square_avg - mean_square
        denominator = sqrt32(variance)
    else:
        denominator = sqrt32(square_avg)
    denominator = denominator + f32(float(group["eps"]))
    ratio = div32(g, denominator)
    lr = f32(float(group["lr"]))
    buffer = None
    if momentum > 0:
        buffer = state["momentum_buffer"].float() * f32(momentum)
        buffer = buffer + ratio
        delta = buffer * lr
    else:
        delta = ratio * lr
    p = p - delta

    store(parameter, p)
    store(state["square_avg"], square_avg)
    if grad_avg is not None:
        store(state["grad_avg"], grad_avg)
    if buffer is not None:
        store(state["momentum_buffer"], buffer)


def _adagrad(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """Adagrad (Duchi et al. 2011, figure 1, diagonal form)."""
    weight_decay = float(group["weight_decay"])
    t = advance(state)
    step_size = f32(float(group["lr"]) / (1.0 + (t - 1) * float(group["lr_decay"])))

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        g = coupled_decay(g, p, weight_decay)
    square = g * g
    total = state["sum"].float() + square
    denominator = sqrt32(total)
    denominator = denominator + f32(float(group["eps"]))
    delta = div32(g, denominator)
    delta = delta * step_size
    p = p - delta

    store(parameter, p)
    store(state["sum"], total)


def _adamax(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """Adamax (Kingma and Ba 2015, algorithm 2)."""
    beta1, beta2 = betas(group)
    weight_decay = float(group["weight_decay"])
    t = advance(state)
    step_size = f32(float(group["lr"]) / (1.0 - power(beta1, t)))

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        g = coupled_decay(g, p, weight_decay)
    m = state["exp_avg"].float() * f32(beta1)
    new = g * f32(1.0 - beta1)
    m = m + new
    norm = state["exp_inf"].float() * f32(beta2)
    magnitude = torch.abs(g)
    magnitude = magnitude + f32(float(group["eps"]))
    norm = torch.maximum(norm, magnitude)
    delta = div32(m, norm)
    delta = delta * step_size
    p = p - delta

    store(parameter, p)
    store(state["exp_avg"], m)
    store(state["exp_inf"], norm)


def _nadam(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """NAdam (Dozat 2016, algorithm 2, with torch.optim's momentum schedule)."""
    beta1, beta2 = betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    momentum_decay = float(group["momentum_decay"])
    t = advance(state)
    mu = beta1 * (1.0 - 0.5 * real_power(_MOMENTUM_BASE, t * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * real_power(_MOMENTUM_BASE, (t + 1) * momentum_decay))
    # torch.optim keeps the product as a float32 tensor: a float32 multiplication (the
    # float64 product of two float32 numbers is exact, so one rounding to float32).
    mu_product = f32(f32(float(state["mu_product"].item())) * f32(mu))
    mu_product_next = mu_product * mu_next
    gradient_size = f32(lr * (1.0 - mu) / (1.0 - mu_product))
    average_size = f32(lr * mu_next / (1.0 - mu_product_next))
    inverse_correction = f32(1.0 / (1.0 - power(beta2, t)))

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", False):
            p = p * f32(1.0 - lr * weight_decay)
        else:
            g = coupled_decay(g, p, weight_decay)
    m, v = moments(g, state, beta1, beta2)
    denominator = v * inverse_correction
    denominator = sqrt32(denominator)
    denominator = denominator + f32(float(group["eps"]))
    delta = div32(g, denominator)
    delta = delta * gradient_size
    p = p - delta
    delta = div32(m, denominator)
    delta = delta * average_size
    p = p - delta

    store(parameter, p)
    store(state["exp_avg"], m)
    store(state["exp_avg_sq"], v)
    state["mu_product"].fill_(mu_product)


def _radam(parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group) -> None:
    """RAdam (Liu et al. 2020, algorithm 2)."""
    beta1, beta2 = betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    t = advance(state)
    correction1 = 1.0 - power(beta1, t)
    beta2_t = power(beta2, t)
    correction2 = 1.0 - beta2_t
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho = rho_inf - 2.0 * t * beta2_t / correction2

    p = parameter.float()
    g = maximized(gradient, group)
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", False):
            p = p * f32(1.0 - lr * weight_decay)
        else:
            g = coupled_decay(g, p, weight_decay)
    m, v = moments(g, state, beta1, beta2)
    if rho > 5.0:  # the adaptive step's variance is tractable (torch.optim's threshold)
        rectification = math.sqrt(
            (rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho)
        )
        step_size = f32(lr * rectification * math.sqrt(correction2) / correction1)
        denominator = sqrt32(v)
        denominator = denominator + f32(float(group["eps"]))
        delta = div32(m, denominator)
        delta = delta * step_size
    else:  # an un-adapted momentum step
        delta = m * f32(lr / correction1)
    p = p - delta

    store(parameter, p)
    store(state["exp_avg"], m)
    store(state["exp_avg_sq"], v)


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
        if optimizer_name in ("Adam", "AdamW"):
            active = adam_in_place_all(active, group, decoupled=optimizer_name == "AdamW")
        for parameter, gradient, state in active:
            apply(parameter, gradient, state, group)


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
