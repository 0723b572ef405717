"""A Flax NNX training loop, written as the Flax guides write it, proved with proof.jit.

The only change to the guide's loop is the decorator: ``@nnx.jit`` becomes
``@proof.jit``. The model, its ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, the
``nnx.value_and_grad`` step and ``optimizer.update(model, grads)`` are unchanged, and
the objects are updated in place as under ``nnx.jit``. The data are scikit-learn's
handwritten digits (they ship inside the package). Run it, then verify the transcript
and replay it as the platform does::

    python examples/jax/nnx_training.py [PROOF_DIR]
    python -m zkdv verify PROOF_DIR
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import zkdv

STEPS, BATCH = 40, 32

config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1),
)
proof = zkdv.jax.ZKDV(
    sys.argv[1] if len(sys.argv) > 1 else "proof", config, replay_snapshot_interval=8
)
# Each committed batch row is one example: 64 pixel intensities, then the label.
proof.start(rolling_window=4, probe_ratio=0.05)


class Classifier(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.norm(self.hidden(pixels / 16.0)))
        return self.out(self.dropout(x))


model = Classifier(rngs=nnx.Rngs(0, dropout=1))
optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
metrics = nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(),
    loss=nnx.metrics.Average("loss"),
)


def loss_fn(model: Classifier, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = model(batch[:, :64].astype(jnp.float32))
    labels = batch[:, 64].astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits


# Was @nnx.jit(donate_argnames=("model", "optimizer")). Donating the optimizer
# donates only the parameters: a sampled check may still need the optimizer state.
@proof.jit(donate_argnames=("model", "optimizer"))
def train_step(
    model: Classifier, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: jax.Array
) -> jax.Array:
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch[:, 64].astype(jnp.int32))
    optimizer.update(model, grads)
    return loss


digits = load_digits()
rows = np.concatenate(
    [digits.data.astype(np.uint32), digits.target.astype(np.uint32)[:, None]], axis=1
)
for step in range(STEPS):
    start = (step * BATCH) % (len(rows) - BATCH)
    train_step(model, optimizer, metrics, jnp.asarray(rows[start : start + BATCH]))
    if (step + 1) % 10 == 0:
        print(f"step {step + 1}: {metrics.compute()}")
        metrics.reset()

proof.close()
print(f"transcript digest {proof.digest.hex() if proof.digest else None}")
