"""Several updates per compiled call (a TPU-style input pipeline), every one proved.

``zkdv.jax.scan`` is ``jax.lax.scan`` with the same arguments; inside ``proof.jit`` each
``apply_gradients`` in its body is a committed transcript step with its own batch
slice, and a sampled check replays one of them. Run it, then verify::

    python examples/jax/scan_training.py [PROOF_DIR]
    python -m zkdv verify PROOF_DIR
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

import zkdv

UPDATES_PER_CALL, CALLS, BATCH = 4, 10, 32

config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1),
)
proof = zkdv.jax.ZKDV(
    sys.argv[1] if len(sys.argv) > 1 else "proof", config, replay_snapshot_interval=6
)
proof.start(rolling_window=4, probe_ratio=0.05)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        return nn.Dense(10)(jax.nn.relu(nn.Dense(64)(pixels / 16.0)))


model = Classifier()
state = zkdv.jax.contrib.TrainState.create(
    proof=proof,
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), jnp.ones((1, 64)))["params"],
    tx=optax.adam(3e-3),
)


@proof.jit(donate_argnums=(0,))
def train_steps(state, batches):  # batches: (UPDATES_PER_CALL, BATCH, 65)
    def update(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[:, :64].astype(jnp.float32))
            labels = batch[:, 64].astype(jnp.int32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    # Was jax.lax.scan: every update inside is one step of the transcript.
    return zkdv.jax.scan(update, state, batches)


digits = load_digits()
rows = np.concatenate(
    [digits.data.astype(np.uint32), digits.target.astype(np.uint32)[:, None]], axis=1
)
per_call = UPDATES_PER_CALL * BATCH
for call in range(CALLS):
    start = (call * per_call) % (len(rows) - per_call)
    batches = rows[start : start + per_call].reshape(UPDATES_PER_CALL, BATCH, 65)
    state, losses = train_steps(state, jnp.asarray(batches))
    print(f"updates {int(state.step) - UPDATES_PER_CALL + 1}-{int(state.step)}: loss {losses}")

proof.close()
