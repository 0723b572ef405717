"""Torch frontend for ZKDV.

``zkdv.torch.ZKDV`` wraps an ordinary eager Torch training loop: prepare the model
and optimizer, decorate the step with ``@proof.attest``, and run each step inside
``with proof.transaction(batch=...)``. See ``docs/torch.md``.

The driver is :mod:`zkdv.torch._driver` (sealing in :mod:`zkdv.torch._sealing`); the
eager objects it hands out are :mod:`zkdv.torch.eager` and :mod:`zkdv.torch.prepared`.

Importing this module imports Torch; ``import zkdv`` alone does not.
"""

from __future__ import annotations

from zkdv.torch import (
    arrays,
    artifact,
    capture,
    checkpoint,
    eager,
    generated,
    lowering,
    model,
    optimizers,
    packing,
    pipeline,
    prepared,
)
from zkdv.torch._driver import ZKDV
from zkdv.torch.arrays import host_array

__all__ = [
    "ZKDV",
    "arrays",
    "artifact",
    "capture",
    "checkpoint",
    "eager",
    "generated",
    "host_array",
    "lowering",
    "model",
    "optimizers",
    "packing",
    "pipeline",
    "prepared",
]
