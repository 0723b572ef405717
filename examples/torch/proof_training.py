"""The Torch counterpart of examples/jax/proof_trainstate.py: a proof uploaded to DVBench.

Start a platform, create an API key in its web UI (API keys), then::

    export DVBENCH_BASE_URL=http://127.0.0.1:8000
    export DVBENCH_API_KEY=dvb_...
    python examples/torch/proof_training.py your-org/torch-linear

Runs on CUDA when there is a device, else on the CPU. The first transaction seals the
attested step as a ``torch.export`` program in a few seconds. With ``DVBENCH_MODE=offline``
nothing is sent and the script prints the ``dvbench sync`` command that uploads it later.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

import zkdv
from dvbench import Client

API_URL = os.environ.get("DVBENCH_BASE_URL", "http://127.0.0.1:8000")
EXPERIMENT = sys.argv[1] if len(sys.argv) > 1 else "your-name/torch-linear"
CHECKPOINT = Path(os.environ.get("CHECKPOINT", "torch-checkpoint.pt"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Connect, register the experiment (on first use), and make its proof: the full
# zkdv.torch.ZKDV driver with DVBench uploads added.
client = Client(API_URL)
experiment = client.experiment(EXPERIMENT)
config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.25),
)
proof = experiment.proof(backend="torch", config=config, replay_snapshot_interval=4)
proof.start(rolling_window=4, probe_ratio=0.5)

torch.manual_seed(0)
model = nn.Linear(10, 2).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = proof.prepare(model, optimizer)


# The attested transition: what the platform replays for a sampled step.
@proof.attest
def attested_step(model, optimizer, batch):
    inputs, targets = batch
    loss = functional.cross_entropy(proof.forward(model, inputs), targets)
    proof.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


generator = torch.Generator().manual_seed(1)
data = [
    (
        torch.randn(8, 10, generator=generator).to(DEVICE),
        torch.randint(2, (8,), generator=generator).to(DEVICE),
    )
    for _ in range(8)
]
for inputs, targets in data:
    with proof.transaction(batch=(inputs, targets)):
        loss = functional.cross_entropy(model(inputs), targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

# Close, upload (resumably; safe to call again), release temporary storage.
result = proof.finish()
torch.save(model.state_dict(), CHECKPOINT)
client.close()

if result.proof_id is not None:
    print(f"proof {result.proof_id} filed: {result.proof_url}")
