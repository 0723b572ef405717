"""ZKDV's JAX frontend: ``proof.jit``, ``proof.attest``, ``Transaction``, Flax TrainState.

A ``proof.jit`` step that trains with Optax commits the gradient its optimizer receives
and applies the update canonically (``zkdv.jax.optimizer``), so the platform replays it
on any hardware; ``zkdv.jax.replay`` rebuilds a proof's step from its files.

Usage (see ``docs/jax.md`` and ``examples/jax/``)::

    proof = zkdv.jax.ZKDV("proof", config)
    proof.start(rolling_window=2, probe_ratio=0.01)
    state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=..., params=..., tx=...)

    @proof.jit(donate_argnums=(0,))
    def train_step(state, batch): ...

    proof.close()
"""

from __future__ import annotations

from zkdv.jax import artifact, contrib
from zkdv.jax._driver import ZKDV
from zkdv.jax._optimizer import CommittedOptimizer, optimizer
from zkdv.jax._scan import scan
from zkdv.jax._transaction import Transaction
from zkdv.jax._tree import index

__all__ = [
    "ZKDV",
    "CommittedOptimizer",
    "Transaction",
    "artifact",
    "contrib",
    "index",
    "optimizer",
    "scan",
]
