"""Functional optimizer contracts used by the Torch frontend.

Every contract calls ``torch.optim``'s own functional core, so the SDK's sampled
checks, the platform's replay and ``Optimizer.step`` share one implementation.
"""

from __future__ import annotations

from zkdv.torch.optimizers import (
    adadelta,
    adafactor,
    adagrad,
    adam,
    adamax,
    adamw,
    asgd,
    base,
    bridge,
    buffers,
    lbfgs,
    muon,
    nadam,
    radam,
    registry,
    rmsprop,
    rprop,
    sgd,
    sparse_adam,
    utils,
)
from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.bridge import OptimizerBridge
from zkdv.torch.optimizers.buffers import pack_optimizer_state
from zkdv.torch.optimizers.registry import OptimizerRegistry

__all__ = [
    "OptimizerBridge",
    "OptimizerContract",
    "OptimizerRegistry",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "asgd",
    "base",
    "bridge",
    "buffers",
    "lbfgs",
    "muon",
    "nadam",
    "pack_optimizer_state",
    "radam",
    "registry",
    "rmsprop",
    "rprop",
    "sgd",
    "sparse_adam",
    "utils",
]
