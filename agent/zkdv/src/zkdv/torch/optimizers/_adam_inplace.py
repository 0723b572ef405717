"""The canonical Adam update in place: the path training runs for float32 Adam and AdamW.

:func:`adam_in_place` computes exactly what the one-parameter definition
(:mod:`zkdv.torch.optimizers.canonical`, zkdv-torch-canonical-v1) computes, bit for bit,
but chunk by chunk into the parameter and its moments, on per-thread scratch reused
across steps; on a CPU whose float32 division is correctly rounded it divides in
float32 (:func:`_ieee_division`), which is ``div32``'s result with less memory traffic.
:func:`adam_in_place_all` updates a group's parameters smaller than a chunk together.
Where Numba is installed (``zkdv[jit]``) a CPU parameter without ``amsgrad`` is updated by
one compiled pass instead (:func:`_adam_pass`): the same operations on each element, in
the same order and precision, read and written once rather than by some twenty
operator calls.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from zkdv._numba import jit
from zkdv.torch.optimizers._arithmetic import (
    Group,
    State,
    advance,
    betas,
    canonical_nan,
    div32,
    f32,
    power,
)

__all__ = ["CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS", "adam_in_place", "adam_in_place_all"]

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
    :func:`div32`'s result with a quarter of the memory traffic. Checked once per
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
    return bool(torch.equal(numerators / denominators, div32(numerators, denominators)))


@dataclass(frozen=True)
class _Scalars:
    """One parameter's Adam step on the host: its options and float32 factors."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    decoupled: bool
    maximize: bool
    step_size: float
    inverse_root_correction: float
    eps: float


def _scalars(state: State, group: Group, *, decoupled: bool) -> _Scalars:
    """The step's host scalars, after advancing ``state["step"]`` (as :func:`advance`)."""
    beta1, beta2 = betas(group)
    lr = float(group["lr"])
    weight_decay = float(group["weight_decay"])
    decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
    maximize = bool(group.get("maximize", False))
    t = advance(state)
    return _Scalars(
        lr=lr,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        decoupled=decoupled,
        maximize=maximize,
        step_size=f32(lr / (1.0 - power(beta1, t))),
        inverse_root_correction=f32(1.0 / math.sqrt(1.0 - power(beta2, t))),
        eps=f32(float(group["eps"])),
    )


def adam_in_place(
    parameter: torch.Tensor, gradient: torch.Tensor, state: State, group: Group, *, decoupled: bool
) -> bool:
    """The canonical Adam update (:func:`~zkdv.torch.optimizers.canonical._adam`)
    computed in place, chunk by chunk, on preallocated scratch.

    The same operations in the same order on every element, so the same bits (tested
    against ``_adam``): an element's result does not depend on which chunk it is in,
    and an in-place or ``out=`` operation rounds as its out-of-place form does. It avoids
    ``_adam``'s dozen fresh tensors the size of the parameter per step, which on a CPU
    cost more than the arithmetic. Covers float32 tensors that are all contiguous;
    returns False (nothing done) otherwise, and ``_adam`` updates the parameter.
    """
    return not adam_in_place_all([(parameter, gradient, state)], group, decoupled=decoupled)


def adam_in_place_all(
    entries: list[tuple[torch.Tensor, torch.Tensor, State]], group: Group, *, decoupled: bool
) -> list[tuple[torch.Tensor, torch.Tensor, State]]:
    """:func:`adam_in_place` for a parameter group: the entries it cannot take come back.

    Parameters smaller than a chunk are updated together, each operation applied to all
    of them by one ``torch._foreach_*`` call (on a CPU a loop in C++ over the tensors,
    each rounded as its own operation): a model of many small tensors (a transformer's
    norms and biases) makes a few dozen operator calls per step rather than twenty per
    tensor. Measured on the LM recipe's 28 parameters, that is no faster on an idle CPU
    (the arithmetic dominates) and loses less when other work shares the cores. Where
    Numba is installed, CPU parameters (without ``amsgrad``) take the compiled pass
    instead, one call each: the LM recipe's update 0.98-1.01 ms against 2.9-3.1 ms by
    the operators (``torch.optim.AdamW``'s own foreach update: 1.17-1.38 ms).
    """
    rest: list[tuple[torch.Tensor, torch.Tensor, State]] = []
    compiled: list[tuple[_Scalars, tuple[torch.Tensor, ...]]] = []
    # Compiled on first use (about a second), and only for CPU parameters of more than
    # SMALL_GROUP_ELEMENTS in all.
    on_cpu = sum(entry[0].numel() for entry in entries if entry[0].device.type == "cpu")
    kernel = _kernel() if on_cpu > SMALL_GROUP_ELEMENTS else None
    small: dict[tuple[torch.device, _Scalars], list[tuple[torch.Tensor, ...]]] = {}
    amsgrad = bool(group.get("amsgrad", False))
    for parameter, gradient, state in entries:
        tensors: tuple[torch.Tensor, ...] = (
            parameter,
            gradient,
            state["exp_avg"],
            state["exp_avg_sq"],
            *([state["max_exp_avg_sq"]] if amsgrad else []),
        )
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or (
            len({t.device for t in tensors}) != 1
        ):
            rest.append((parameter, gradient, state))
            continue
        scalars = _scalars(state, group, decoupled=decoupled)
        flat = tuple(tensor.view(-1) for tensor in tensors)
        device = parameter.device
        if device.type == "cpu" and not amsgrad and kernel is not None:
            compiled.append((scalars, flat))
            continue
        chunk = CHUNK_ELEMENTS.get(device.type, DEVICE_CHUNK_ELEMENTS)
        if parameter.numel() <= chunk:
            small.setdefault((device, scalars), []).append(flat)
            continue
        scratch = _buffers(device, chunk)
        for start in range(0, parameter.numel(), chunk):
            stop = min(start + chunk, parameter.numel())
            n = stop - start
            _adam_lists(
                scalars,
                [[tensor[start:stop]] for tensor in flat],
                [[buffer[:n]] for buffer in scratch],
            )
        _canonical_if_nan([flat])
    if compiled:
        _compiled(kernel, compiled)
    for (device, scalars), members in small.items():
        chunk = CHUNK_ELEMENTS.get(device.type, DEVICE_CHUNK_ELEMENTS)
        for batch in _batches(members, chunk):
            scratch = _buffers(device, sum(flat[0].numel() for flat in batch))
            views: list[list[torch.Tensor]] = [[] for _ in scratch]
            offset = 0
            for flat in batch:
                n = flat[0].numel()
                for into, buffer in zip(views, scratch, strict=True):
                    into.append(buffer[offset : offset + n])
                offset += n
            _adam_lists(scalars, [list(tensors) for tensors in zip(*batch, strict=True)], views)
            _canonical_if_nan(batch)
    return rest


def _compiled(kernel: Any, entries: list[tuple[_Scalars, tuple[torch.Tensor, ...]]]) -> None:
    """Update CPU parameters by the compiled pass, on numpy views of their tensors."""
    arguments: dict[_Scalars, tuple[Any, ...]] = {}
    for s, flat in entries:
        scalars = arguments.get(s)
        if scalars is None:
            f = np.float32
            decay = s.weight_decay != 0
            scalars = arguments[s] = (
                s.maximize,
                f(s.weight_decay if decay and not s.decoupled else 0.0),
                f(1.0 - s.lr * s.weight_decay if decay and s.decoupled else 1.0),
                f(s.beta1),
                f(1.0 - s.beta1),
                f(s.beta2),
                f(1.0 - s.beta2),
                f(s.inverse_root_correction),
                f(s.eps),
                f(s.step_size),
            )
        p, g, m, v = (tensor.detach().numpy() for tensor in flat)
        if kernel(p, g, m, v, *scalars):
            _canonical_nans([flat[0], flat[2], flat[3]])
        # Written through numpy: tell autograd, as an in-place operator would have.
        torch.autograd.graph.increment_version([flat[0], flat[2], flat[3]])


def _batches(
    members: list[tuple[torch.Tensor, ...]], limit: int
) -> list[list[tuple[torch.Tensor, ...]]]:
    """Consecutive runs of parameters of at most ``limit`` elements in all."""
    batches: list[list[tuple[torch.Tensor, ...]]] = [[]]
    filled = 0
    for flat in members:
        n = flat[0].numel()
        if batches[-1] and filled + n > limit:
            batches.append([])
            filled = 0
        batches[-1].append(flat)
        filled += n
    return batches


def _canonical_if_nan(updated: list[tuple[torch.Tensor, ...]]) -> None:
    """Make each updated parameter's and its moments' NaNs canonical, if it can hold any.

    ``updated``: ``(parameter, gradient, moments...)`` per parameter, all on one device.
    A NaN anywhere in the moments reaches the parameter (through the quotient), and a
    parameter's 1-norm is NaN exactly when it holds a NaN, so on a CPU one read of the
    norms tells which parameters must be made canonical, with no copy. On an
    accelerator reading it would wait for the device: always canonical.
    """
    if updated[0][0].device.type == "cpu":
        norms = torch.stack(torch._foreach_norm([flat[0] for flat in updated], 1)).isnan()
        if not bool(norms.any()):
            return
        updated = [flat for flat, nan in zip(updated, norms.tolist(), strict=True) if nan]
    for flat in updated:
        _canonical_nans([flat[0], *flat[2:]])


def _adam_lists(
    s: _Scalars, tensors: list[list[torch.Tensor]], scratch: list[list[torch.Tensor]]
) -> None:
    """The update's operations on lists of 1-D tensors: parameters, gradients, first and
    second moments (and the amsgrad maximum), with two float32 and two float64 scratch
    tensors of the same lengths. Every ``torch._foreach_*`` call applies one operation
    to each tensor of its list, the operation :func:`_adam` applies to the whole
    parameter, so every element is rounded as there.
    """
    p, g, m, v = tensors[:4]
    vmax = tensors[4] if len(tensors) > 4 else None
    ga, gb, fa, fb = scratch
    if s.maximize or (s.weight_decay != 0 and not s.decoupled):
        torch._foreach_copy_(ga, g)
        if s.maximize:
            torch._foreach_neg_(ga)
        if s.weight_decay != 0 and not s.decoupled:
            torch._foreach_copy_(gb, p)
            torch._foreach_mul_(gb, f32(s.weight_decay))
            torch._foreach_add_(ga, gb)
        g = ga
    if s.weight_decay != 0 and s.decoupled:
        torch._foreach_mul_(p, f32(1.0 - s.lr * s.weight_decay))
    torch._foreach_mul_(m, f32(s.beta1))
    torch._foreach_copy_(gb, g)
    torch._foreach_mul_(gb, f32(1.0 - s.beta1))
    torch._foreach_add_(m, gb)
    torch._foreach_copy_(gb, g)
    torch._foreach_mul_(gb, g)
    torch._foreach_mul_(gb, f32(1.0 - s.beta2))
    torch._foreach_mul_(v, f32(s.beta2))
    torch._foreach_add_(v, gb)
    vhat = v
    if vmax is not None:
        torch._foreach_maximum_(vmax, v)
        vhat = vmax
    torch._foreach_copy_(fa, vhat)  # sqrt32: through float64
    torch._foreach_sqrt_(fa)
    torch._foreach_copy_(gb, fa)
    torch._foreach_mul_(gb, s.inverse_root_correction)
    torch._foreach_add_(gb, s.eps)
    # The quotient m / denominator, into ga (the gradient's copy is no longer read).
    if _ieee_division(p[0].device):
        torch._foreach_copy_(ga, m)  # div32: the device divides float32 correctly
        torch._foreach_div_(ga, gb)
    else:
        torch._foreach_copy_(fa, m)  # div32: through float64
        torch._foreach_copy_(fb, gb)
        torch._foreach_div_(fa, fb)
        torch._foreach_copy_(ga, fa)
    torch._foreach_mul_(ga, s.step_size)
    torch._foreach_sub_(p, ga)


# --- One compiled pass (Numba) ---------------------------------------------------------------

#: Set to ``0`` to take the operator path even where Numba is installed.
JIT_ENV = "ZKDV_ADAM_JIT"
#: A group of at most this many CPU elements takes the operator path and never builds the
#: compiled pass. Building it (Numba's import and its cached kernel) costs a process about
#: 1.4 s: a replay child of the platform, which updates the state of a challenged step or
#: three, spent most of its arithmetic there on a small model. Both paths give the same
#: bits (``tests/agent/zkdv/torch/test_canonical_optimizers.py``).
SMALL_GROUP_ELEMENTS = 1 << 16
_kernel_state: dict[str, Any] = {}


def _kernel() -> Any:
    """The compiled pass, or None without Numba (or with ``ZKDV_ADAM_JIT=0``)."""
    return jit(_kernel_state, JIT_ENV, _adam_pass, _try_pass)


def _try_pass(kernel: Any) -> None:
    one = np.ones(2, dtype=np.float32)
    f = np.float32
    kernel(one, one.copy(), one.copy(), one.copy(), False, f(0), f(1), *([f(0.5)] * 7))


def _adam_pass(
    p: Any,
    g: Any,
    m: Any,
    v: Any,
    negate: bool,
    coupled_decay: Any,
    decoupled_factor: Any,
    beta1: Any,
    one_minus_beta1: Any,
    beta2: Any,
    one_minus_beta2: Any,
    inverse_root_correction: Any,
    eps: Any,
    step_size: Any,
) -> bool:  # pragma: no cover - compiled by Numba (its bits are tested against _adam's)
    """:func:`_adam_lists` on one float32 parameter, element by element: the same float32
    operations in the same order (every scalar a float32), the square root through
    float64 (``sqrt32``) and the quotient a float32 division, correctly rounded on a
    CPU (``div32``'s result, :func:`_ieee_division`). No fast-math: nothing is fused or
    reassociated. Returns whether a NaN was written (its payload is then made canonical,
    as :func:`_canonical_if_nan` does on the operator path)."""
    nan = False
    for i in range(p.shape[0]):
        grad = -g[i] if negate else g[i]
        if coupled_decay != 0:
            grad = grad + p[i] * coupled_decay
        parameter = p[i] * decoupled_factor
        first = m[i] * beta1 + grad * one_minus_beta1
        square = (grad * grad) * one_minus_beta2
        second = v[i] * beta2 + square
        root = np.float32(math.sqrt(np.float64(second)))
        denominator = root * inverse_root_correction + eps
        updated = parameter - (first / denominator) * step_size
        m[i] = first
        v[i] = second
        p[i] = updated
        # A NaN in either moment reaches the quotient, hence the parameter.
        nan |= updated != updated
    return nan


def _canonical_nans(tensors: list[torch.Tensor]) -> None:
    """:func:`store`'s NaN rule, in place, for float32 tensors updated in place."""
    for tensor in tensors:
        tensor.masked_fill_(torch.isnan(tensor), canonical_nan(torch.float32, tensor.device))
