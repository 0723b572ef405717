"""Train a small Flax classifier on real handwritten digits, with a DVBench proof.

The data are scikit-learn's ``load_digits`` (1,797 8x8 images of the digits 0-9 from
the UCI repository, which ship inside the package, so nothing is downloaded). This is
the JAX half of ``./scripts/demo``; run it on its own against any platform::

    export DVBENCH_BASE_URL=http://127.0.0.1:8000
    export DVBENCH_API_KEY=dvb_...          # a trainer's key
    python examples/jax/digits.py your-org/digits-jax

The experiment is registered on first use with the default spec (nothing declared);
register it first with declared limits (``dvbench experiments create NAME --spec FILE``)
to have them checked. With ``DVBENCH_MODE=offline`` nothing is sent: the proof stays on
disk and ``dvbench sync`` uploads it later. Knobs: ``DIGITS_PROOF_DIR`` (keep
the proof there, e.g. to check a report's transcript digest later; default: a temporary
directory removed once uploaded), ``DIGITS_MODEL_DIR`` (save the final weights there as
``model.safetensors``, signed in the OpenSSF model-signing format, and have the
certificate bind them), ``DIGITS_STEPS`` (default 60),
``DIGITS_BATCH`` (rows per step, default 50). The last line printed is JSON (proof id,
test accuracy, steps) for scripts that drive this one.

``python examples/jax/digits.py --dataset-commitment`` prints the data set commitment to
declare in the experiment's spec and exits: the SHA-256 of the batch roots of the exact
batches this run trains on, in step order (what the platform's dataset claim checks).

The model, the step and :func:`train` can be imported (``tests/agent/zkdv/jax`` trains them
on other CPU instruction sets and replays them): the run commits each step's gradient
and the platform replays Adam's update from it bit for bit (``docs/jax.md``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

import zkdv
import zkdv.batch
from dvbench import Client

EXPERIMENT = sys.argv[1] if len(sys.argv) > 1 else "your-name/digits-jax"
STEPS = int(os.environ.get("DIGITS_STEPS", "60"))
BATCH = int(os.environ.get("DIGITS_BATCH", "50"))
PIXELS, CLASSES, HELD_OUT = 64, 10, 297
ROLLING_WINDOW = 4


def digit_rows() -> tuple[np.ndarray, np.ndarray]:
    """Training and held-out rows: 64 pixel intensities (0-16) then the label, as uint32.

    One row is one example, so each committed batch row is a whole example (what a
    data-content query asks about). The split is fixed, so a rerun trains on the same
    batches.
    """
    digits = load_digits()
    rows = np.concatenate(
        [digits.data.astype(np.uint32), digits.target.astype(np.uint32)[:, None]], axis=1
    )
    order = np.random.default_rng(0).permutation(len(rows))
    rows = rows[order]
    return rows[HELD_OUT:], rows[:HELD_OUT]


class DigitClassifier(nn.Module):
    """A two-layer perceptron over the 64 pixel intensities."""

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        hidden = nn.relu(nn.Dense(32)(pixels.astype(jnp.float32) / 16.0))
        return nn.Dense(CLASSES)(hidden)


def batches(rows: np.ndarray, steps: int = STEPS) -> list[np.ndarray]:
    """The batch of each step, in order: epochs over the fixed training split."""
    per_epoch = len(rows) // BATCH
    return [rows[(step % per_epoch) * BATCH :][:BATCH] for step in range(steps)]


def dataset_commitment(rows: np.ndarray) -> str:
    """SHA-256 of the committed batch roots in step order, computed before training.

    Each batch is one uint32 array, committed as it is (zkdv.batch.commit_batch with the
    run's rolling window), so the lab can declare its data before the first step.
    """
    roots = (zkdv.batch.commit_batch(batch, ROLLING_WINDOW).root for batch in batches(rows))
    return hashlib.sha256(b"".join(roots)).hexdigest()


def initial_state(proof: zkdv.jax.ZKDV, seed: int = 0) -> zkdv.jax.contrib.TrainState:
    """The classifier's initial parameters (from ``seed``) and Adam, owned by ``proof``."""
    model = DigitClassifier()
    params = model.init(jax.random.key(seed), jnp.zeros((1, PIXELS), dtype=jnp.uint32))["params"]
    return zkdv.jax.contrib.TrainState.create(
        proof=proof, apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
    )


def train(proof: zkdv.jax.ZKDV, rows: np.ndarray, steps: int = STEPS, *, seed: int = 0) -> Any:
    """Train ``steps`` steps on ``rows`` under ``proof`` (started), from the initial
    parameters of ``seed``; returns the state."""
    state = initial_state(proof, seed)

    # proof.jit instead of jax.jit: every call is one committed, replayable transition.
    @proof.jit(donate_argnums=(0,))
    def train_step(state, batch):
        pixels, labels = batch[:, :PIXELS], batch[:, PIXELS].astype(jnp.int32)

        def loss(params):
            logits = state.apply_fn({"params": params}, pixels)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    for batch in batches(rows, steps):
        state = train_step(state, jnp.asarray(batch))
    return state


def main() -> None:
    train_rows, held_out = digit_rows()
    if "--dataset-commitment" in sys.argv:
        print(dataset_commitment(train_rows))
        return

    # Connect, look up (or register) the experiment, start its proof before the state exists.
    client = Client()
    experiment = client.experiment(EXPERIMENT)
    config = zkdv.ZKDVConfig(
        # The trainer's own sampled re-executions: one step in ten on average.
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1),
    )
    # A replay snapshot every 10 steps: a challenged step replays at most 9 transitions.
    proof = experiment.proof(
        backend="jax",
        config=config,
        path=os.environ.get("DIGITS_PROOF_DIR"),
        replay_snapshot_interval=10,
    )
    proof.start(rolling_window=ROLLING_WINDOW, probe_ratio=0.25)
    proof.declare_regime("pretraining")  # from scratch; checked against the spec's regimes

    state = train(proof, train_rows)

    # The final weights, signed; finish() uploads them and the certificate binds them.
    if os.environ.get("DIGITS_MODEL_DIR"):
        saved = proof.save_model(state.params, os.environ["DIGITS_MODEL_DIR"])
        print(
            f"final model: {saved.copies[0]} sha256 {saved.sha256} (signed: {saved.signature.name})"
        )

    # Close (wait for commitments and sampled checks), upload, answer what the platform asks.
    result = proof.finish()
    client.close()

    logits = state.apply_fn({"params": state.params}, jnp.asarray(held_out[:, :PIXELS]))
    accuracy = float((jnp.argmax(logits, axis=1) == held_out[:, PIXELS]).mean())
    print(f"held-out accuracy after {STEPS} steps: {accuracy:.1%} ({len(held_out)} digits)")
    print(json.dumps({"proof_id": result.proof_id, "accuracy": accuracy, "steps": STEPS}))


if __name__ == "__main__":
    main()
