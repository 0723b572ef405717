"""The README's JAX quick start, runnable: a Flax TrainState under proof.jit.

Run it, then verify the transcript offline::

    python examples/jax/train_state.py
    python -m zkdv verify proof
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import zkdv

# Initialize ZKDV once, before compiling the training step.
config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01),
)
proof = zkdv.jax.ZKDV("proof", config)
proof.start(rolling_window=2, probe_ratio=0.01)


# Create the state as usual. ZKDV adds only the proof owner and an optional
# exportable replacement for apply_fn.
def apply_fn(variables, batch):
    return variables["params"] * batch


state = zkdv.jax.contrib.TrainState.create(
    proof=proof,
    apply_fn=apply_fn,
    params=jnp.arange(8, dtype=jnp.float32),
    tx=optax.adam(1e-3),
)


# Replace @jax.jit with @proof.jit. The body remains ordinary Flax/JAX code,
# including arbitrary loss construction and any number of apply_fn calls.
@proof.jit(donate_argnums=(0,))
def train_step(state, batch):
    def loss(params):
        predictions = state.apply_fn({"params": params}, batch)
        return jnp.mean(predictions)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


for _ in range(10):
    state = train_step(state, jnp.ones((8,), dtype=jnp.float32))

# Close once, after the training loop.
proof.close()
