"""The Freivalds projections ``c_i = <R, G_i>`` that the lab and the platform share.

The random directions ``R`` drawn from a challenge's seed, the float64 inner product,
and :func:`sequence_projections`, the one implementation (Torch, imported when called)
of a block's per-sequence forward, backward and projections on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zkdv.merkle import LeafSpec


def projection_directions(
    seed: bytes, specs: Sequence[LeafSpec], count: int
) -> list[list[np.ndarray]]:
    """``count`` independent standard-normal directions ``R``, one array per block tensor.

    Drawn with numpy's PCG64 from the challenge seed (float64), so the lab and the
    platform draw the same ones on any machine.
    """
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:16], "little")))
    return [[generator.standard_normal(spec.shape) for spec in specs] for _ in range(count)]


def inner(a: np.ndarray, b: np.ndarray) -> float:
    """``<a, b>`` in float64 over all elements.

    An elementwise product and numpy's pairwise sum, not ``np.vdot``: BLAS ``ddot``
    runs on OpenBLAS's thread pool, which on a loaded machine spent milliseconds per
    call here waking threads for a few thousand elements.
    """
    return float(np.multiply(a, b, dtype=np.float64).sum())


def sequence_projections(
    block: Any,
    params: dict[str, Any],
    h_in: Any,
    dh_out: Any,
    directions: Sequence[Sequence[np.ndarray]],
) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Run one block forward and backward on some sequences, from committed boundaries.

    The lab computes its answer with this function and the platform recomputes the opened
    sequences with it: one implementation on both sides. Everything runs in float64 (the
    boundaries and weights are float32 values, exactly representable), so the two sides
    differ only by summation order, far below the tolerances.

    Args:
        block: the block module (its own parameters are not used).
        params: the block's parameters by name, relative to the block.
        h_in: ``(sequences, length, width)`` float tensor, the block's input rows.
        dh_out: the loss gradient at the block's output, same shape.
        directions: ``[q][tensor]`` Freivalds directions in ``params``' order.

    Returns:
        ``(h_out, dh_in, c, norms)``: float64 output and input gradient, ``c[q][i] =
        <R_q, G_i>`` for each sequence ``i``, and ``|G_i|`` (L2 over the block).
    """
    import torch
    from torch.func import functional_call

    names = list(params)
    rows = int(h_in.shape[0])
    c = np.zeros((len(directions), rows))
    norms = np.zeros(rows)
    outs, grads_in = [], []
    for i in range(rows):
        weights = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in params.items()}
        x = h_in[i : i + 1].detach().to(torch.float64).requires_grad_(True)
        with torch.enable_grad():
            out = functional_call(block, weights, (x,))
            gradients = torch.autograd.grad(
                out, [x, *(weights[k] for k in names)], dh_out[i : i + 1].to(torch.float64)
            )
        outs.append(out.detach())
        grads_in.append(gradients[0])
        flat = [g.numpy() for g in gradients[1:]]
        norms[i] = math.sqrt(sum(inner(g, g) for g in flat))
        for q, direction in enumerate(directions):
            c[q, i] = sum(inner(r, g) for r, g in zip(direction, flat, strict=True))
    return torch.cat(outs), torch.cat(grads_in), c, norms
