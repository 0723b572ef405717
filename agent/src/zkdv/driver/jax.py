"""The JAX driver at the API reference's layout, ``zkdv.driver.<backend>``.

The implementation lives in :mod:`zkdv.jax._driver` so that importing either module first
works (``zkdv.jax`` re-exports :class:`ZKDV`; this module re-exports the same objects).
"""

from __future__ import annotations

from zkdv.jax._driver import ZKDV
from zkdv.jax._program import JIT_OPTIONS, JitFunction

__all__ = ["JIT_OPTIONS", "ZKDV", "JitFunction"]
