"""Fine-tune with Hugging Face's ``Trainer`` and prove it: two added lines.

A ``Trainer`` script as the Hugging Face docs write it: a ``GPT2LMHeadModel`` (built from
a small config, nothing downloaded; load your own with ``from_pretrained``), a tokenized
dataset, ``DataCollatorForLanguageModeling``, and ``TrainingArguments`` with the things
fine-tuning runs use: AdamW, a linear schedule with warmup, ``gradient_accumulation_steps``,
``max_grad_norm``, ``bf16=True``, dropout 0.1. The two lines marked ``# zkdv`` prove every
optimizer step; nothing else in the script knows about it::

    python examples/torch/hf_trainer.py --proof-dir /tmp/trainer-proof
    python -m zkdv verify /tmp/trainer-proof

With ``--experiment OWNER/NAME`` (and ``DVBENCH_BASE_URL`` / ``DVBENCH_API_KEY`` set) the proof
is filed with DVBench at the end of training, with the signed final weights; with
``--report-to wandb`` the W&B run records the proof's digest, URL and verdict. The same script
runs under ``accelerate launch --num_processes 2`` (pass ``--max-grad-norm 0``: clipping is
not yet replayable across processes; see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

import zkdv
from zkdv.integrations.transformers import prove  # zkdv

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
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words ``w1`` ... ``w127`` (``<pad>`` is 0).

    Built in memory with the ``tokenizers`` library, so nothing is downloaded; a real
    run loads its own with ``AutoTokenizer.from_pretrained``.
    """
    vocab = {"<pad>": 0, **{f"w{index}": index for index in range(1, VOCAB)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>")


def markov_text(rows: int, *, seed: int) -> list[str]:
    """Sentences of a fixed random Markov chain over the words: something to learn."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(1, VOCAB, (VOCAB, 4), generator=generator)
    ids = torch.empty((rows, CONTEXT), dtype=torch.int64)
    ids[:, 0] = torch.randint(1, VOCAB, (rows,), generator=generator)
    choices = torch.randint(4, (rows, CONTEXT), generator=generator)
    for position in range(1, CONTEXT):
        ids[:, position] = successors[ids[:, position - 1], choices[:, position]]
    return [" ".join(f"w{token}" for token in row) for row in ids.tolist()]


def tokenized(tokenizer: transformers.PreTrainedTokenizerFast, texts: list[str]) -> list[Any]:
    """The dataset, tokenized as a fine-tuning script tokenizes it."""
    encoded = tokenizer(texts, truncation=True, max_length=CONTEXT)
    return [
        {name: encoded[name][index] for name in ("input_ids", "attention_mask")}
        for index in range(len(texts))
    ]


def training_arguments(output_dir: str | Path, **overrides: Any) -> transformers.TrainingArguments:
    """The run's arguments: what a fine-tune sets, on the CPU, without a tracker by default."""
    options: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 12,
        "learning_rate": 1e-3,
        "weight_decay": 0.01,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "max_grad_norm": 1.0,
        "bf16": True,
        "use_cpu": True,
        "seed": 0,
        "dataloader_drop_last": True,
        "logging_steps": 4,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
    }
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def make_trainer(
    output_dir: str | Path,
    *,
    model: torch.nn.Module | None = None,
    rows: int = 96,
    seed: int = 0,
    trainer_class: type[transformers.Trainer] = transformers.Trainer,
    **overrides: Any,
) -> transformers.Trainer:
    """A ``Trainer`` over the Markov-text dataset, as a fine-tuning script builds one."""
    transformers.set_seed(seed)
    tokenizer = word_tokenizer()
    return trainer_class(
        model=small_gpt2() if model is None else model,
        args=training_arguments(output_dir, seed=seed, **overrides),
        train_dataset=tokenized(tokenizer, markov_text(rows, seed=seed + 1)),
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proof-dir", type=Path, default=None)
    parser.add_argument("--experiment", default=None, help="file the proof with DVBench")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--check-every", type=int, default=None, help="check every N-th step")
    parser.add_argument(
        "--report-to", default="none", help="the Trainer's trackers (wandb, mlflow)"
    )
    arguments = parser.parse_args()
    output = Path(tempfile.mkdtemp(prefix="hf-trainer-"))

    trainer = make_trainer(
        output,
        max_steps=arguments.steps,
        max_grad_norm=arguments.max_grad_norm,
        report_to=arguments.report_to,
    )
    policy = (
        zkdv.SamplingPolicy.DEBUGCheckEvery(arguments.check_every)
        if arguments.check_every
        else zkdv.SamplingPolicy()
    )
    experiment = None
    if arguments.experiment:
        import dvbench

        experiment = dvbench.Client().experiment(arguments.experiment)
    proof = prove(  # zkdv
        trainer,
        arguments.proof_dir or output / "proof",
        experiment=experiment,
        config=zkdv.ZKDVConfig(sampling_policy=policy),
    )
    result = trainer.train()
    trainer.save_model(str(output / "model"))

    if trainer.is_world_process_zero():
        summary = {
            "steps": proof.steps,
            "train_loss": result.training_loss,
            "proof_dir": str(proof.path),
            "transcript_digest": proof.digest,
        }
        if proof.url:
            summary["proof_url"] = proof.url
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
