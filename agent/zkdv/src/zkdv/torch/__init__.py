"""Torch frontend for ZKDV.

``zkdv.torch.ZKDV`` wraps an ordinary eager Torch training loop: prepare the model
and optimizer, decorate the step with ``@proof.attest``, and run each step inside
``with proof.transaction(batch=...)``. See ``docs/torch.md``.

What is public: the driver :class:`ZKDV`; :func:`host_array` (bit-exact host copies of
tensors, what commitments hash); :class:`BatchLayout` (a batch packed into the committed
rows, so a dataset commitment can be computed before training); the functional
optimizer contracts (:mod:`zkdv.torch.optimizers`, with the canonical update); and the
provers' replay interface (:mod:`zkdv.torch.replay`). ``zkdv.torch.generated`` is a
stable import target for lowered program code. Every other module is private: the driver
is :mod:`zkdv.torch._driver` (sealing in :mod:`zkdv.torch._sealing`); the eager objects
it hands out are :mod:`zkdv.torch._eager` and :mod:`zkdv.torch._prepared`.

Importing this module imports Torch; ``import zkdv`` alone does not.
"""

from __future__ import annotations

from zkdv.torch import _vml, generated, optimizers
from zkdv.torch._arrays import host_array
from zkdv.torch._driver import ZKDV
from zkdv.torch._packing import BatchLayout

# Before anything computes with Torch on several threads (zkdv.torch._vml).
_vml.initialize()

__all__ = ["ZKDV", "BatchLayout", "generated", "host_array", "optimizers"]
