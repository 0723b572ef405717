"""Train a small PyTorch classifier on real handwritten digits, with a DVBench proof.

The Torch counterpart of ``examples/jax/digits.py`` and the model ``./scripts/demo
--torch`` trains: scikit-learn's ``load_digits`` (1,797 8x8 images of the digits 0-9,
shipped inside the package, so nothing is downloaded)::

    export DVBENCH_BASE_URL=http://127.0.0.1:8000
    export DVBENCH_API_KEY=dvb_...          # a trainer's key
    python examples/torch/digits.py your-org/digits-torch

Runs on CUDA when there is a device, else on the CPU. The first transaction seals a
serialized ``torch.export`` program in a few seconds, replayed by Torch's eager
kernels. Knobs: ``DIGITS_PROOF_DIR`` (keep
the proof there, e.g. to check a report's transcript digest later; default: a temporary
directory removed once uploaded), ``DIGITS_STEPS`` (default 60),
``DIGITS_BATCH`` (rows per step, default 50), ``DIGITS_MODEL_DIR`` (save the final weights
there as ``model.safetensors``, signed in the OpenSSF model-signing format, and have the
certificate bind them). The last line printed is JSON (proof id,
test accuracy, steps) for scripts that drive this one.

``python examples/torch/digits.py --dataset-commitment`` prints the data set commitment
to declare in the experiment's spec and exits: the SHA-256 of the batch roots of the
exact batches this run trains on, in step order (what the platform's dataset claim checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional

import zkdv
import zkdv.batch
from dvbench import Client
from zkdv.torch import BatchLayout

EXPERIMENT = sys.argv[1] if len(sys.argv) > 1 else "your-name/digits-torch"
STEPS = int(os.environ.get("DIGITS_STEPS", "60"))
BATCH = int(os.environ.get("DIGITS_BATCH", "50"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PIXELS, CLASSES, HELD_OUT = 64, 10, 297
ROLLING_WINDOW = 4


def digit_tensors() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(pixels, labels) for training and held out; intensities 0-16 as exact floats.

    The split is fixed (seeded permutation), so a rerun trains on the same batches.
    """
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    pixels = torch.tensor(digits.data[order], dtype=torch.float32)
    labels = torch.tensor(digits.target[order], dtype=torch.int64)
    return (pixels[HELD_OUT:], labels[HELD_OUT:]), (pixels[:HELD_OUT], labels[:HELD_OUT])


def batches(pixels: torch.Tensor, labels: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch of each step, in order: epochs over the fixed training split."""
    per_epoch = len(labels) // BATCH
    starts = [(step % per_epoch) * BATCH for step in range(STEPS)]
    return [(pixels[i : i + BATCH], labels[i : i + BATCH]) for i in starts]


def dataset_commitment(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """SHA-256 of the committed batch roots in step order, computed before training.

    Each batch is packed into uint32 rows exactly as a transaction packs it
    (zkdv.torch.BatchLayout) and committed with zkdv.batch.commit_batch.
    """
    layout = BatchLayout.of(steps[0], min_words=ROLLING_WINDOW)
    roots = (zkdv.batch.commit_batch(layout.pack(b), ROLLING_WINDOW).root for b in steps)
    return hashlib.sha256(b"".join(roots)).hexdigest()


(train_pixels, train_labels), (test_pixels, test_labels) = digit_tensors()
if "--dataset-commitment" in sys.argv:
    print(dataset_commitment(batches(train_pixels, train_labels)))
    sys.exit(0)

# Connect, look up (or register) the experiment, make its proof: the zkdv.torch driver.
client = Client()
experiment = client.experiment(EXPERIMENT)
config = zkdv.ZKDVConfig(
    # The trainer's own sampled re-executions: one step in ten on average.
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1),
)
# A replay snapshot every 10 steps: a challenged step replays at most 9 transitions.
proof = experiment.proof(
    backend="torch",
    config=config,
    path=os.environ.get("DIGITS_PROOF_DIR"),
    replay_snapshot_interval=10,
)
proof.start(rolling_window=ROLLING_WINDOW, probe_ratio=0.25)
proof.declare_regime("pretraining")  # from scratch; checked against the spec's regimes

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(PIXELS, 32), nn.ReLU(), nn.Linear(32, CLASSES)).to(DEVICE)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer = proof.prepare(model, optimizer)


# The attested transition: what a sampled check, and the platform's replay, re-executes.
@proof.attest
def attested_step(model, optimizer, batch):
    pixels, labels = batch
    loss = functional.cross_entropy(proof.forward(model, pixels / 16.0), labels)
    proof.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


for pixels, labels in batches(train_pixels, train_labels):
    pixels, labels = pixels.to(DEVICE), labels.to(DEVICE)
    with proof.transaction(batch=(pixels, labels)):
        loss = functional.cross_entropy(model(pixels / 16.0), labels)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

# The final weights, signed; finish() uploads them and the certificate binds them.
if os.environ.get("DIGITS_MODEL_DIR"):
    saved = proof.save_model(model, os.environ["DIGITS_MODEL_DIR"])
    print(f"final model: {saved.copies[0]} sha256 {saved.sha256} (signed: {saved.signature.name})")

# Close (wait for commitments and sampled checks), upload, answer what the platform asks.
result = proof.finish()
client.close()

with torch.no_grad():
    predicted = model(test_pixels.to(DEVICE) / 16.0).argmax(dim=1).cpu()
accuracy = float((predicted == test_labels).float().mean())
print(f"held-out accuracy after {STEPS} steps: {accuracy:.1%} ({len(test_labels)} digits)")
print(json.dumps({"proof_id": result.proof_id, "accuracy": accuracy, "steps": STEPS}))
