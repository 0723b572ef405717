"""ZKDV: a tamper-evident, replay-checkable transcript of a JAX or PyTorch training loop.

Shared configuration lives at the package root; the framework frontends load lazily as
``zkdv.jax`` and ``zkdv.torch`` (PEP 562), so ``import zkdv`` needs neither framework.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zkdv import overlap
from zkdv.config import FloatTolerance, GradientBounds, SamplingPolicy, ZKDVConfig
from zkdv.errors import ZKDVError, ZKDVPoisonedError, ZKDVVerificationError

if TYPE_CHECKING:
    from zkdv import jax, torch

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = [
    "PROTOCOL_VERSION",
    "FloatTolerance",
    "GradientBounds",
    "SamplingPolicy",
    "ZKDVConfig",
    "ZKDVError",
    "ZKDVPoisonedError",
    "ZKDVVerificationError",
    "jax",
    "overlap",
    "torch",
]

_LAZY = frozenset({"jax", "torch"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"zkdv.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'zkdv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
