"""What a ``proof.jit`` step costs, counted from its jaxpr: the FLOPs its records carry.

:func:`matmul_flops` counts the matrix products and convolutions of a traced step,
forward and backward, the way ``torch.utils.flop_counter`` counts them for the Torch
frontend; :data:`FLOP_METHOD` names the method in the transcript's environment.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLOP_METHOD", "matmul_flops"]

FLOP_METHOD = "matrix products and convolutions of the step's jaxpr, forward and backward"


def matmul_flops(jaxpr: Any) -> float:
    """FLOPs of the matrix products and convolutions in ``jaxpr`` (a traced step).

    ``2 x output elements x contracted elements`` per ``dot_general`` and per
    ``conv_general_dilated`` (the contraction is the kernel's input features per group
    times its window), as ``torch.utils.flop_counter`` counts ``mm``, ``bmm`` and
    convolutions. Nested programs count once each, a ``scan`` body ``length`` times,
    a ``cond`` its costliest branch, a ``while`` body once (its trip count is not
    static). Shapes are the jaxpr's logical ones: a sharded program's whole step.
    """
    from jax.extend import core as jax_core

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in inner.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = math.prod(eqn.outvars[0].aval.shape)
            total += 2.0 * out * math.prod(lhs[d] for d in contract)
        elif name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *window)
            window = math.prod(kernel[d] for d in spec[2:])
            out = math.prod(eqn.outvars[0].aval.shape)
            total += 2.0 * out * kernel[spec[1]] * window
        subs = list(jax_core.jaxprs_in_params(eqn.params))
        if not subs:
            continue
        counts = [matmul_flops(sub) for sub in subs]
        if name == "scan":
            total += float(eqn.params["length"]) * sum(counts)
        elif name == "cond":
            total += max(counts)
        else:
            total += sum(counts)
    return total
