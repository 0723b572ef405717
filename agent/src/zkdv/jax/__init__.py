"""ZKDV's JAX frontend: ``proof.jit``, ``proof.attest``, ``Transaction``, Flax TrainState.

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
from zkdv.jax._context import Transaction
from zkdv.jax._driver import ZKDV
from zkdv.jax._scan import scan
from zkdv.jax._tree import index

__all__ = ["ZKDV", "Transaction", "artifact", "contrib", "index", "scan"]
