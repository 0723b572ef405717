"""Torch frontend for ZKDV.

``zkdv.torch.ZKDV`` wraps an ordinary eager Torch training loop: prepare the model
and optimizer, decorate the step with ``@proof.attest``, and run each step inside
``with proof.transaction(batch=...)``. See ``docs/torch.md``.

Importing this module imports Torch; ``import zkdv`` alone does not.
"""

from __future__ import annotations

from zkdv.driver.torch import ZKDV
from zkdv.torch import (
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

__all__ = [
    "ZKDV",
    "artifact",
    "capture",
    "checkpoint",
    "eager",
    "generated",
    "lowering",
    "model",
    "optimizers",
    "packing",
    "pipeline",
    "prepared",
]
