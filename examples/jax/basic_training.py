"""The explicit ZKDV JAX API: zkdv.jax.Transaction inside proof.jit, and proof.attest.

Lower-level integrations that do not use Flax's TrainState declare the transaction
themselves and register the attested program, the hermetic function a sampled check
re-executes. Run it, then verify the transcript offline::

    python examples/jax/basic_training.py [PROOF_DIR]
    python -m zkdv verify PROOF_DIR
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zkdv

FEATURES, CLASSES, ROWS = 16, 4, 32

config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.25),
)
# A replay snapshot every 5 steps: a sampled check replays at most 4 transitions.
proof = zkdv.jax.ZKDV(
    sys.argv[1] if len(sys.argv) > 1 else "proof", config, replay_snapshot_interval=5
)
# Each committed batch row is one example: FEATURES token ids followed by the label.
proof.start(rolling_window=4, probe_ratio=0.05)

tx = optax.adamw(1e-2)


def init(key: jax.Array) -> dict[str, jax.Array]:
    w_key, e_key = jax.random.split(key)
    return {
        "embed": jax.random.normal(e_key, (256, 32)) * 0.05,
        "w": jax.random.normal(w_key, (32, CLASSES)) * 0.05,
        "b": jnp.zeros((CLASSES,)),
    }


def loss_fn(params: dict[str, jax.Array], batch: jax.Array) -> jax.Array:
    tokens, labels = batch[:, :FEATURES], batch[:, FEATURES].astype(jnp.int32)
    hidden = params["embed"][tokens].mean(axis=1)
    logits = hidden @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def update(params, opt_state, batch):
    """The transition both functions below compute: the single source of truth."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    return loss, updates, new_opt_state


# The attested program: fixed ABI, two scalar outputs. zkdv.jax.index selects the
# challenged coordinates from the full trees (ZKDV also derives the full transition from
# them, which a replay from a snapshot applies to the steps before the challenged one).
@proof.attest
def attested_step(params, opt_state, batch, parameter_index, optimizer_state_index):
    _, updates, new_opt_state = update(params, opt_state, batch)
    return (
        zkdv.jax.index(updates, parameter_index),
        zkdv.jax.index(new_opt_state, optimizer_state_index),
    )


# The production step: ordinary JAX, with the transaction declared around the update.
# Parameters are donated; the pre-update optimizer state must not be.
@proof.jit(donate_argnums=(0,))
def train_step(params, opt_state, batch, overlap):
    transaction = zkdv.jax.Transaction(
        batch=batch, params=params, opt_state=opt_state, overlap=overlap
    )
    loss, updates, new_opt_state = update(params, opt_state, batch)
    new_params = optax.apply_updates(params, updates)
    transaction.update(deltas=updates, params=new_params, opt_state=new_opt_state)
    return new_params, new_opt_state, loss


def batches(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, 256, (ROWS, FEATURES), dtype=np.uint32)
        labels = (tokens[:, :1] % CLASSES).astype(np.uint32)
        out.append(np.concatenate([tokens, labels], axis=1))
    return out


params = init(jax.random.key(0))
opt_state = tx.init(params)
for step, batch in enumerate(batches(20)):
    # The overlap policy is host-side metadata: changing it per call does not retrace.
    policy = zkdv.overlap.NEVER if step % 10 == 9 else zkdv.overlap.UNCHECKED
    params, opt_state, loss = train_step(params, opt_state, jnp.asarray(batch), policy)
    if step % 5 == 0:
        print(f"step {step}: loss {float(loss):.4f}")

proof.close()
print(f"transcript digest {proof.digest.hex()}")
