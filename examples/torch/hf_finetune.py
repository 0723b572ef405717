"""Fine-tune a Hugging Face GPT-2 with a ZKDV proof, the model unchanged.

The model is ``transformers.GPT2LMHeadModel`` built from a small ``GPT2Config`` (nothing
is downloaded; to fine-tune real weights, load them with ``from_pretrained`` from your
own storage instead). It keeps Hugging Face's defaults, dropout 0.1 everywhere and SDPA
attention, and the loop is the one the Hugging Face course writes:

* ``outputs = model(**batch)`` with ``labels`` in the batch, and ``outputs.loss``;
* a partial fine-tune: the embeddings and the lower blocks are frozen
  (``requires_grad=False``) and AdamW holds only the trained parameters;
* ``transformers.get_linear_schedule_with_warmup``, stepped after every step;
* ``clip_grad_norm_(1.0)`` before the optimizer step.

ZKDV draws every dropout mask from a seed committed in the transcript, so a sampled
check and the platform's replay reproduce them; the frozen parameters are committed
too, and checked unchanged. Install the extra first (``pip install 'zkdv[hf]'``), then::

    python examples/torch/hf_finetune.py --steps 30 --proof-dir /tmp/hf-proof
    python -m zkdv verify /tmp/hf-proof
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

import zkdv
from zkdv.verify import verify_transcript

VOCAB, CONTEXT = 128, 16


def small_gpt2(*, layers: int = 2, width: int = 32, heads: int = 4) -> transformers.GPT2LMHeadModel:
    """A GPT-2 from a small configuration, with Hugging Face's default dropout (0.1)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def freeze_lower_layers(model: transformers.GPT2LMHeadModel, trained_blocks: int = 1) -> None:
    """Freeze the embeddings and every block but the last ``trained_blocks``."""
    transformer = model.transformer
    for module in (transformer.wte, transformer.wpe, *transformer.h[:-trained_blocks]):
        module.requires_grad_(False)


def batches(*, steps: int, rows: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Tokenizer-shaped batches (``input_ids``, ``attention_mask``, ``labels``).

    Sequences of a fixed random Markov chain, so the fine-tune has something to learn.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 4), generator=generator)
    for _ in range(steps):
        ids = torch.empty((rows, CONTEXT), dtype=torch.int64)
        ids[:, 0] = torch.randint(VOCAB, (rows,), generator=generator)
        choices = torch.randint(4, (rows, CONTEXT), generator=generator)
        for position in range(1, CONTEXT):
            ids[:, position] = successors[ids[:, position - 1], choices[:, position]]
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train(
    path: str | Path,
    *,
    steps: int = 24,
    seed: int = 0,
    zkdv_config: zkdv.ZKDVConfig | None = None,
    snapshot_interval: int = 4,
    rows: int = 8,
    width: int = 32,
    lr: float = 1e-3,
    device: str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``steps`` steps into the proof directory ``path``; returns a summary."""
    torch.manual_seed(seed)
    model = small_gpt2(width=width).to(device)
    freeze_lower_layers(model)
    model.train()
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.01)

    proof = zkdv.torch.ZKDV(path, zkdv_config, replay_snapshot_interval=snapshot_interval)
    proof.start(rolling_window=8, probe_ratio=0.05)
    model, optimizer = proof.prepare(model, optimizer)
    schedule = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
    )

    @proof.attest
    def train_step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        outputs = proof.forward(model, **batch)
        proof.backward(outputs.loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return outputs.loss.detach()

    losses = []
    for index, batch in enumerate(batches(steps=steps, rows=rows, seed=seed + 1)):
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
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
    path = arguments.proof_dir or Path(tempfile.mkdtemp(prefix="zkdv-hf-"))
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
