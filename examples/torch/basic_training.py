"""A fully commented Torch training loop that writes a ZKDV transcript.

Run it with::

    python examples/torch/basic_training.py [PROOF_DIR]

It trains a small classifier for 24 steps on CUDA when a device is present, else on
the CPU, and then verifies the transcript offline exactly as ``python -m zkdv verify
PROOF_DIR`` does. The first transaction seals the attested step as a ``torch.export``
program, which a sampled check (and the platform) runs with Torch's eager kernels, the
ones this loop trains with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv.verify import verify_transcript

# The proof directory must be new for every run: a transcript is append-only.
PROOF_DIR = Path(sys.argv[1] if len(sys.argv) > 1 else "proof-torch-basic")
# Prefer the GPU; the same code runs on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STEPS = 24

# Seed torch once so the run (and its transcript) is reproducible.
torch.manual_seed(0)

# 1. The proof. Each step is independently sampled for a re-execution check with
#    probability 0.25 (1 to 5% is typical in production). A full pre-state snapshot is
#    taken every 4 steps, so a check replays at most 3 earlier steps.
config = zkdv.ZKDVConfig(
    name="torch-basic-training",
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.25),
)
proof = zkdv.torch.ZKDV(PROOF_DIR, config, replay_snapshot_interval=4)
# rolling_window: words per rolling-hash window within each committed batch row (for
# later "did this data appear in training?" queries); probe_ratio: the fraction of each
# parameter row kept by the small linear probes written with every step.
proof.start(rolling_window=8, probe_ratio=0.05)

# 2. An ordinary model and optimizer. BatchNorm's running statistics are mutable buffers:
#    ZKDV commits them with the parameters. (No bias before BatchNorm: its gradient is
#    mathematically zero, and rounding noise on it is not reproducible by a replay.)
model = nn.Sequential(
    nn.Linear(32, 64, bias=False),
    nn.BatchNorm1d(64),
    nn.ReLU(),
    nn.Linear(64, 4),
).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

# 3. prepare() binds the model's state layout and wraps the optimizer. The model comes
#    back unchanged; the optimizer keeps its native behaviour and API.
model, optimizer = proof.prepare(model, optimizer)


# 4. The attested step: the hermetic transition that a sampled check (and the DVBench
#    platform) recomputes. proof.forward and proof.backward expose the module call and
#    the gradient boundary to the tracer; optimizer.step() marks the update, which is
#    replayed with torch.optim's own functional AdamW.
@proof.attest
def attested_step(model, optimizer, batch):
    inputs, targets = batch
    loss = functional.cross_entropy(proof.forward(model, inputs), targets)
    proof.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


# A synthetic task: four Gaussian blobs. Data is generated outside the transaction; any
# randomness the step needs (dropout masks, noise) must be part of the batch too.
generator = torch.Generator().manual_seed(1)
centres = torch.randn(4, 32, generator=generator) * 2


def batch_of(size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(4, (size,), generator=generator)
    inputs = centres[labels] + torch.randn(size, 32, generator=generator)
    return inputs.to(DEVICE), labels.to(DEVICE)


# 5. The training loop, unchanged except for the transaction. Open it before the
#    forward, so the buffers the forward mutates are captured first; everything the
#    step consumes goes in `batch` (it is copied into the committed batch on entry).
for step in range(STEPS):
    inputs, targets = batch_of()
    with proof.transaction(batch=(inputs, targets)):
        loss = functional.cross_entropy(model(inputs), targets)
        proof.backward(loss)  # plain loss.backward() in eager code
        optimizer.step()  # waits for the previous commitment, then the native step
        optimizer.zero_grad()
    if step % 8 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")

# 6. close() waits for queued commitments and sampled checks, writes the close record,
#    and raises zkdv.ZKDVPoisonedError if a sampled check failed.
proof.close()
print(f"sealing the attested program took {proof.sealing_seconds:.1f} s (once per run)")

# 7. The offline verifier: chain, schema, every sampling decision, probes, counts.
report = verify_transcript(PROOF_DIR)
print(report.summary())
sys.exit(0 if report.ok else 1)
