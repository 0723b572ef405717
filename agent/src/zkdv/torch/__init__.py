"""Torch frontend for ZKDV.

``zkdv.torch.ZKDV`` wraps an ordinary eager Torch training loop: prepare the model
and optimizer, decorate the step with ``@proof.attest``, and run each step inside
``with proof.transaction(batch=...)``. See ``docs/torch.md``.

Importing this module imports Torch; ``import zkdv`` alone does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from zkdv.driver.torch import ZKDV

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


def __getattr__(name: str) -> Any:
    # Resolved on first use: zkdv.driver.torch imports this package's submodules, so
    # either module can be imported first (``from zkdv.driver.torch import ZKDV`` is
    # where the API reference places the class).
    if name == "ZKDV":
        from zkdv.driver.torch import ZKDV

        globals()["ZKDV"] = ZKDV
        return ZKDV
    raise AttributeError(f"module 'zkdv.torch' has no attribute {name!r}")
