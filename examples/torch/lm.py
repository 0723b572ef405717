"""Pre-train a small causal transformer LM with the recipe LLM teams use, with a ZKDV proof.

Everything a real pre-training loop does, and the ZKDV calls beside it:

* a GPT-style decoder (token and position embeddings, pre-norm blocks,
  ``scaled_dot_product_attention`` with a causal mask, GELU MLP, dropout 0.1) whose LM
  head shares the embedding's weight (tied weights);
* AdamW with the usual two parameter groups: weight decay on the matrices (embeddings
  included), none on biases and normalisation scales;
* a linear-warmup, cosine-decay learning rate (``LambdaLR``) stepped after every step;
* two micro-batches per step, gradients accumulated, then ``clip_grad_norm_(1.0)``;
* the forward under ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision).

The attested step is the training step: the loop calls it inside
``proof.transaction``. Outside tracing, ``proof.forward(model, x)`` is ``model(x)``,
``proof.backward(loss)`` is ``loss.backward()`` and the prepared optimizer's ``step()``
is AdamW's, so the eager step and the program a sampled check (or the platform) replays
are one piece of code::

    python examples/torch/lm.py --steps 40 --proof-dir /tmp/lm-proof
    python -m zkdv verify /tmp/lm-proof

The data is synthetic (a fixed random token stream, so nothing is downloaded); swap
:func:`token_batches` for your loader. The last line printed is JSON (proof directory,
final loss, steps, sampled checks).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv.verify import verify_transcript


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 128
    width: int = 32
    heads: int = 4
    layers: int = 2
    context: int = 16
    dropout: float = 0.1


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.attention_norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.projection = nn.Linear(config.width, config.width)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)
        self.residual_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        attended = attended.transpose(1, 2).reshape(batch, length, width)
        x = x + self.residual_dropout(self.projection(attended))
        hidden = functional.gelu(self.up(self.mlp_norm(x)))
        return x + self.residual_dropout(self.down(hidden))


class TinyLM(nn.Module):
    """A GPT-style decoder whose LM head is tied to the token embedding."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one Parameter, committed once
        self.apply(self._initialize)

    @staticmethod
    def _initialize(module: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's usual groups: decay the matrices, not biases, norms (rank-one tensors)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier: linear warmup, then cosine decay to zero."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def token_batches(
    config: LMConfig, *, steps: int, micro_batches: int, rows: int, seed: int
) -> Iterator[torch.Tensor]:
    """One ``(micro_batches, rows, context + 1)`` tensor of token ids per step.

    Sequences of a fixed random Markov chain (each token has four likely successors), so
    there is something to learn: the loss falls from ln(vocab) towards ln(4).
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(config.vocab, (config.vocab, 4), generator=generator)
    shape = (micro_batches * rows, config.context + 1)
    for _ in range(steps):
        tokens = torch.empty(shape, dtype=torch.int64)
        tokens[:, 0] = torch.randint(config.vocab, (shape[0],), generator=generator)
        choices = torch.randint(4, shape, generator=generator)
        for position in range(1, shape[1]):
            tokens[:, position] = successors[tokens[:, position - 1], choices[:, position]]
        yield tokens.view(micro_batches, rows, -1)


def train(
    path: str | Path,
    *,
    steps: int = 24,
    seed: int = 0,
    config: LMConfig | None = None,
    zkdv_config: zkdv.ZKDVConfig | None = None,
    snapshot_interval: int = 4,
    micro_batches: int = 2,
    rows: int = 8,
    lr: float = 3e-3,
    max_grad_norm: float = 1.0,
    device: str = "cpu",
    autocast: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps into the proof directory ``path``; returns a summary."""
    config = config or LMConfig()
    torch.manual_seed(seed)
    model = TinyLM(config).to(device)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=lr, betas=(0.9, 0.95))

    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=snapshot_interval)
    proof.start(rolling_window=8, probe_ratio=0.05)
    model, optimizer = proof.prepare(model, optimizer)
    # Created after prepare(), stepped between transactions: each step's learning rate
    # is committed in its step record and replayed with it.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(max(1, steps // 10), steps)
    )

    def lm_loss(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            logits = proof.forward(model, tokens[:, :-1])
        return functional.cross_entropy(
            logits.float().reshape(-1, config.vocab), tokens[:, 1:].reshape(-1)
        )

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=batch.device)
        for micro in batch.unbind(0):  # gradient accumulation over the micro-batches
            loss = lm_loss(micro) / batch.shape[0]
            proof.backward(loss)
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        return total

    losses = []
    for index, batch in enumerate(
        token_batches(config, steps=steps, micro_batches=micro_batches, rows=rows, seed=seed + 1)
    ):
        batch = batch.to(device)
        with proof.transaction(batch=batch):
            loss = train_step(model, optimizer, batch)
        schedule.step()
        losses.append(float(loss))
        if on_step is not None:
            on_step(index, losses[-1])
    proof.close()
    return {"proof_dir": str(path), "steps": steps, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--proof-dir", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="intra-op CPU threads")
    parser.add_argument("--check-every", type=int, default=None, help="check every N-th step")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    policy = (
        zkdv.SamplingPolicy.DEBUGCheckEvery(arguments.check_every)
        if arguments.check_every
        else zkdv.SamplingPolicy(update_check_probability=0.1)
    )
    path = arguments.proof_dir or Path(tempfile.mkdtemp(prefix="zkdv-lm-"))
    summary = train(
        path,
        steps=arguments.steps,
        seed=arguments.seed,
        zkdv_config=zkdv.ZKDVConfig(sampling_policy=policy),
        device=arguments.device,
        on_step=lambda index, loss: print(f"step {index:4d}  loss {loss:.4f}", flush=True),
    )
    report = verify_transcript(path)
    losses = summary.pop("losses")
    summary.update(first_loss=losses[0], final_loss=losses[-1], checks=report.checks)
    summary["verified"] = report.summary()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
