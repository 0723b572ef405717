"""The NNX adaptor's split of an object into its traced parts: an internal API.

``proof.jit`` takes Flax NNX objects (a model, an ``nnx.Optimizer``) by splitting each
into a :class:`~zkdv.jax._nnx.Graph` (its graph definition, its state with random keys
as their data, and its ``nnx.Variable`` s) before the call, and after it setting those
Variables to the step's outputs. ``bench/jax_nnx_scan.py`` times that host-side work
alone, against the step, so it calls the adaptor's own split through
:func:`split_graph`; the adaptor is :mod:`zkdv.jax._nnx`.
"""

from __future__ import annotations

from typing import Any

from zkdv.jax._nnx import Graph, _split

__all__ = ["Graph", "split_graph"]


def split_graph(node: Any) -> Graph:
    """Split the NNX object ``node`` as ``proof.jit`` does before each call."""
    return _split(node)
