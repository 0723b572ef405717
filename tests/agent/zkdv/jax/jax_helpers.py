"""Shared actors of the JAX frontend tests: a small model, batches, a transcript check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zkdv.verify import verify_transcript  # noqa: E402

FEATURES = 6


def apply_fn(variables: dict[str, Any], batch: jax.Array) -> jax.Array:
    """A tiny regression model: ``tanh(x @ w) . v``."""
    params = variables["params"]
    return jnp.tanh(batch @ params["w"]) @ params["v"]


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    key_w, key_v = jax.random.split(jax.random.key(seed))
    return {
        "w": jax.random.normal(key_w, (FEATURES, 8)) * 0.3,
        "v": jax.random.normal(key_v, (8,)) * 0.3,
    }


def batches(steps: int, rows: int = 4, seed: int = 1) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.standard_normal((rows, FEATURES + 1)), jnp.float32) for _ in range(steps)
    ]


def loss(state: Any, params: Any, batch: jax.Array) -> jax.Array:
    predictions = state.apply_fn({"params": params}, batch[:, :FEATURES])
    return jnp.mean((predictions - batch[:, FEATURES]) ** 2)


def train_step(state: Any, batch: jax.Array) -> Any:
    """One plain training step of a ``TrainState`` on :func:`loss`."""
    grads = jax.grad(lambda p: loss(state, p, batch))(state.params)
    return state.apply_gradients(grads=grads)


def assert_verifies(path: Path) -> Any:
    report = verify_transcript(path)
    assert report.ok, report.summary()
    return report
