"""Torch's device chunk roots, as the benches time them: an internal API.

``bench/device_commit.py`` times each backend's device hashing of one state beside the
host's, the JAX kernels through :mod:`zkdv.jax.device_merkle` and Torch's through this
module, which re-exports :func:`~zkdv.torch._device_merkle.chunk_roots` (dispatch every
tensor's chunk root on its device) and :func:`~zkdv.torch._device_merkle.roots_bytes`
(read them back as digests). The driver itself uses :mod:`zkdv.torch._device_merkle`.
"""

from __future__ import annotations

from zkdv.torch._device_merkle import chunk_roots, roots_bytes

__all__ = ["chunk_roots", "roots_bytes"]
