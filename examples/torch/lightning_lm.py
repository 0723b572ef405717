"""Train a language model with Lightning and prove it: one callback, the module unchanged.

A ``LightningModule`` as Lightning's docs write one (a small causal transformer with
dropout; ``training_step`` returns the loss and logs it; ``configure_optimizers`` returns
AdamW and a per-step OneCycle schedule) trained by ``lightning.Trainer`` with
``accumulate_grad_batches``, ``gradient_clip_val`` and ``precision="bf16-mixed"``. The
``ZKDVCallback`` in ``callbacks`` (the lines marked ``# zkdv``) proves every optimizer
step::

    python examples/torch/lightning_lm.py --proof-dir /tmp/lightning-proof
    python -m zkdv verify /tmp/lightning-proof

(The file is not named ``lightning.py``: run as a script, it would shadow the package.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv.integrations.lightning import ZKDVCallback  # zkdv

VOCAB, CONTEXT = 64, 16


class CausalLM(pl.LightningModule):
    """A one-block causal transformer LM with dropout."""

    def __init__(self, *, width: int = 32, heads: int = 4, lr: float = 3e-3, steps: int = 12):
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(CONTEXT, width)
        self.dropout = nn.Dropout(0.1)
        self.block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device)
        hidden = self.dropout(self.tokens(ids) + self.positions(positions))
        hidden = self.block(hidden, src_mask=self.mask[:length, :length], is_causal=True)
        return self.head(hidden)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.hparams.steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class MarkovData(pl.LightningDataModule):
    """Sequences of a fixed random Markov chain, shuffled each epoch."""

    def __init__(self, *, rows: int = 96, batch_size: int = 4, seed: int = 1) -> None:
        super().__init__()
        self.rows, self.batch_size, self.seed = rows, batch_size, seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        successors = torch.randint(VOCAB, (VOCAB, 4), generator=generator)
        ids = torch.empty((self.rows, CONTEXT + 1), dtype=torch.int64)
        ids[:, 0] = torch.randint(VOCAB, (self.rows,), generator=generator)
        choices = torch.randint(4, (self.rows, CONTEXT + 1), generator=generator)
        for position in range(1, CONTEXT + 1):
            ids[:, position] = successors[ids[:, position - 1], choices[:, position]]
        self.data = ids

    def train_dataloader(self) -> torch.utils.data.DataLoader[torch.Tensor]:
        return torch.utils.data.DataLoader(
            self.data,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
        )


def make_trainer(callbacks: list[pl.Callback], *, steps: int = 12, **overrides: Any) -> pl.Trainer:
    """The ``lightning.Trainer`` of the run, on the CPU."""
    options: dict[str, Any] = {
        "max_steps": steps,
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.5,
        "precision": "bf16-mixed",
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(overrides)
    return pl.Trainer(callbacks=callbacks, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proof-dir", type=Path, default=None)
    parser.add_argument("--experiment", default=None, help="file the proof with DVBench")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--check-every", type=int, default=None, help="check every N-th step")
    arguments = parser.parse_args()
    policy = (
        zkdv.SamplingPolicy.DEBUGCheckEvery(arguments.check_every)
        if arguments.check_every
        else zkdv.SamplingPolicy()
    )
    experiment = None
    if arguments.experiment:
        import dvbench

        experiment = dvbench.Client().experiment(arguments.experiment)
    proof = ZKDVCallback(  # zkdv
        arguments.proof_dir or Path(tempfile.mkdtemp(prefix="lightning-")) / "proof",
        experiment=experiment,
        config=zkdv.ZKDVConfig(sampling_policy=policy),
    )
    pl.seed_everything(0)
    trainer = make_trainer([proof], steps=arguments.steps)
    trainer.fit(CausalLM(steps=arguments.steps), MarkovData())
    summary = {
        "steps": proof.run.steps,
        "proof_dir": str(proof.path),
        "transcript_digest": proof.digest,
    }
    if proof.run.url:
        summary["proof_url"] = proof.run.url
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
