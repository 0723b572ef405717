"""The DVBench tutorial "Train a Flax model with TrainState", runnable against a platform.

Start a platform, create an API key in its web UI (API keys), then::

    export DVBENCH_BASE_URL=http://127.0.0.1:8000
    export DVBENCH_API_KEY=dvb_...
    python examples/jax/proof_trainstate.py your-org/jax-train-state

The experiment is registered on first use (the key needs the trainer or admin role in
the organisation). With ``DVBENCH_MODE=offline`` nothing is sent; the proof stays on
disk and the script prints the ``dvbench sync`` command that uploads it later.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import serialization

import zkdv
from dvbench import Client

API_URL = os.environ.get("DVBENCH_BASE_URL", "http://127.0.0.1:8000")
EXPERIMENT = sys.argv[1] if len(sys.argv) > 1 else "your-name/jax-train-state"
CHECKPOINT = Path(os.environ.get("CHECKPOINT", "jax-checkpoint.msgpack"))

# 2. Start a JAX proof: connect, register the experiment, start its proof before the
# training state exists. The proof is the full zkdv.jax.ZKDV driver.
client = Client(API_URL)
experiment = client.experiment(EXPERIMENT)
config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(
        update_check_probability=0.01,
    ),
)
proof = experiment.proof(backend="jax", config=config)
proof.start(rolling_window=4, probe_ratio=0.01)


# 3. Create the model and state: zkdv.jax.contrib.TrainState in place of Flax's.
class TinyClassifier(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(2)(tokens.astype(jnp.float32))


model = TinyClassifier()
params = model.init(
    jax.random.key(0),
    jnp.ones((1, 4), dtype=jnp.uint32),
)["params"]

state = zkdv.jax.contrib.TrainState.create(
    proof=proof,
    apply_fn=model.apply,
    params=params,
    tx=optax.adam(1e-2),
)


# 4. Compile the training step with proof.jit instead of jax.jit.
@proof.jit(donate_argnums=(0,))
def train_step(state, batch):
    tokens = batch[:, :4]
    labels = batch[:, 4].astype(jnp.int32)

    def loss(params):
        logits = state.apply_fn({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits,
            labels,
        ).mean()

    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)


# 5. Train normally.
batch = jnp.asarray(
    [
        [0, 0, 0, 1, 0],
        [0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
        [1, 1, 1, 0, 1],
    ],
    dtype=jnp.uint32,
)

for _ in range(10):
    state = train_step(state, batch)

# 6. Finish (wait for commitments and checks, upload, release temporary storage), then
# save the checkpoint. finish() is safe to call more than once.
result = proof.finish()
CHECKPOINT.write_bytes(
    serialization.to_bytes(state.params),
)
client.close()

if result.proof_id is not None:
    print(f"proof {result.proof_id} filed: {result.proof_url}")
