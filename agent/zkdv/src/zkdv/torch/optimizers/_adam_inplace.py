"""The canonical Adam update in place: the path training runs for float32 Adam and AdamW.

:func:`adam_in_place` computes exactly what the one-parameter definition
(:mod:`zkdv.torch.optimizers.canonical`, zkdv-torch-canonical-v1) computes, bit for bit,
but chunk by chunk into the parameter and its moments, on per-thread scratch reused
across steps; on a CPU whose float32 division is correctly rounded it divides in
float32 (:func:`_ieee_division`), which is ``div32``'s result with less memory traffic.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cache

import torch

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

__all__ = ["CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS", "adam_in_place"]

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
    amsgrad = bool(group.get("amsgrad", False))
    tensors = [parameter, gradient, state["exp_avg"], state["exp_avg_sq"]]
    if amsgrad:
        tensors.append(state["max_exp_avg_sq"])
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    scalars = _scalars(state, group, decoupled=decoupled)
    flat = [tensor.view(-1) for tensor in tensors]
    p, g, m, v = flat[:4]
    vmax = flat[4] if amsgrad else None
    total = p.numel()
    chunk = CHUNK_ELEMENTS.get(p.device.type, DEVICE_CHUNK_ELEMENTS)
    scratch = _buffers(p.device, min(chunk, max(total, 1)))
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        n = stop - start
        _adam_chunk(
            scalars,
            (p[start:stop], g[start:stop], m[start:stop], v[start:stop]),
            None if vmax is None else vmax[start:stop],
            (scratch[0][:n], scratch[1][:n], scratch[2][:n], scratch[3][:n]),
        )
    # A NaN anywhere in the moments reaches the parameter (through the quotient), so on
    # a CPU the parameter's sum tells whether any NaN must be made canonical: one read, no
    # copy. On an accelerator reading it would wait for the device: always canonical.
    if p.device.type != "cpu" or bool(torch.isnan(p.sum())):
        _canonical_nans(tensors[:1] + tensors[2:])
    return True


def _adam_chunk(
    s: _Scalars,
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    vmax: torch.Tensor | None,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """One chunk of :func:`adam_in_place`: parameter, gradient and moments (and the
    amsgrad maximum) updated in place, on two float32 and two float64 scratch vectors."""
    pc, gc, mc, vc = chunk
    ga, gb, fa, fb = scratch
    if s.maximize or (s.weight_decay != 0 and not s.decoupled):
        ga.copy_(gc)
        if s.maximize:
            ga.neg_()
        if s.weight_decay != 0 and not s.decoupled:
            torch.mul(pc, f32(s.weight_decay), out=gb)
            ga.add_(gb)
        gc = ga
    if s.weight_decay != 0 and s.decoupled:
        pc.mul_(f32(1.0 - s.lr * s.weight_decay))
    mc.mul_(f32(s.beta1))
    torch.mul(gc, f32(1.0 - s.beta1), out=gb)
    mc.add_(gb)
    torch.mul(gc, gc, out=gb)
    gb.mul_(f32(1.0 - s.beta2))
    vc.mul_(f32(s.beta2))
    vc.add_(gb)
    vhat = vc
    if vmax is not None:
        vhat = vmax
        torch.maximum(vhat, vc, out=vhat)
    fa.copy_(vhat)  # sqrt32: through float64
    fa.sqrt_()
    gb.copy_(fa)
    gb.mul_(s.inverse_root_correction)
    gb.add_(s.eps)
    if _ieee_division(pc.device):
        torch.div(mc, gb, out=gb)  # div32: the device divides float32 correctly
    else:
        fa.copy_(mc)  # div32: through float64
        fb.copy_(gb)
        fa.div_(fb)
        gb.copy_(fa)
    gb.mul_(s.step_size)
    pc.sub_(gb)


def _canonical_nans(tensors: list[torch.Tensor]) -> None:
    """:func:`store`'s NaN rule, in place, for float32 tensors updated in place."""
    for tensor in tensors:
        tensor.masked_fill_(torch.isnan(tensor), canonical_nan(torch.float32, tensor.device))
