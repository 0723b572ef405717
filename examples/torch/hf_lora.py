"""A LoRA fine-tune with PEFT and Hugging Face's ``Trainer``, proved: two added lines.

``peft.get_peft_model`` puts LoRA adapters on a Llama built from a small config (nothing
downloaded): its base weights are frozen, the Trainer's AdamW holds only the adapters.
The proof commits every weight, base included: the adapters' updates are replayed and
the base is checked unchanged at every step. With an experiment, the final weights
(adapters and base, named as PEFT names them) are signed and bound to the certificate::

    python examples/torch/hf_lora.py --proof-dir /tmp/lora-proof
    python -m zkdv verify /tmp/lora-proof
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import peft
import transformers

import zkdv
from zkdv.integrations.transformers import prove  # zkdv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import CONTEXT, VOCAB, make_trainer


def small_llama() -> transformers.LlamaForCausalLM:
    """A two-layer Llama from a config, with attention dropout as fine-tunes often set it."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        attention_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def lora(model: Any, *, rank: int = 4) -> peft.PeftModel:
    """LoRA adapters on the attention projections, with LoRA dropout; the base frozen."""
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.05,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def make_lora_trainer(output_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Any:
    """A ``Trainer`` over a LoRA-adapted small Llama."""
    transformers.set_seed(seed)
    return make_trainer(output_dir, model=lora(small_llama()), seed=seed, **overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proof-dir", type=Path, default=None)
    parser.add_argument("--experiment", default=None, help="file the proof with DVBench")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--check-every", type=int, default=None, help="check every N-th step")
    arguments = parser.parse_args()
    output = Path(tempfile.mkdtemp(prefix="hf-lora-"))

    trainer = make_lora_trainer(output, max_steps=arguments.steps, learning_rate=3e-3)
    trainer.model.print_trainable_parameters()
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
    trainer.save_model(str(output / "adapter"))  # PEFT's adapter files

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
