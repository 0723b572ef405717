"""A small causal transformer language model, trained with a ZKDV proof (Flax + Optax).

The recipe of a typical LM run, scaled down to run on a laptop CPU in seconds: a
pre-LayerNorm decoder (two blocks, causal self-attention, GELU MLP) over a synthetic
token stream, AdamW with a linear warmup and cosine decay (``optax.warmup_cosine_decay_
schedule``), weight decay on matrices only, ``optax.clip_by_global_norm(1.0)``, and
gradient accumulation over two micro-batches *inside* the step (the step's gradient is
their mean). What the proof commits at every step is the gradient the optimizer
receives, after accumulation and before clipping (clipping is part of the Optax chain,
so the platform replays it canonically from that gradient)::

    python examples/jax/lm.py [PROOF_DIR]      # default: a temporary directory

It trains ``LM_STEPS`` steps (default 24) of ``LM_BLOCKS`` blocks (default 2) with one
sampled self-check in four, then
prints the loss, verifies the transcript and replays every window with the platform's
prover (``provers.jax_replay``) when it is importable (a repository checkout).
:func:`train` is imported by ``tests/agent/zkdv/jax``, which trains the recipe on another CPU
instruction set and replays it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import zkdv
from zkdv.verify import verify_transcript

VOCAB, WIDTH, HEADS, CONTEXT = 32, 32, 2, 16
BLOCKS = int(os.environ.get("LM_BLOCKS", "2"))
MICRO_BATCHES, MICRO_BATCH = 2, 4
STEPS = int(os.environ.get("LM_STEPS", "24"))


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention, then a GELU MLP."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.SelfAttention(num_heads=HEADS, deterministic=True)(nn.LayerNorm()(x), mask)
        h = nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x)))
        return x + nn.Dense(WIDTH)(h)


class LM(nn.Module):
    """Token and position embeddings, ``blocks`` blocks, a final norm and the logits."""

    blocks: int = BLOCKS

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (CONTEXT, WIDTH))
        for _ in range(self.blocks):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def token_batches(steps: int, seed: int = 0) -> list[np.ndarray]:
    """Each step's tokens, ``(MICRO_BATCHES * MICRO_BATCH, CONTEXT + 1)`` uint32.

    A learnable stream: each sequence counts up from a random start with a random
    stride, modulo the vocabulary, with one token in ten replaced by noise.
    """
    rng = np.random.default_rng(seed)
    rows = MICRO_BATCHES * MICRO_BATCH
    out = []
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (rows, 1))
        stride = rng.integers(1, 4, (rows, 1))
        tokens = (start + stride * np.arange(CONTEXT + 1)[None, :]) % VOCAB
        noise = rng.random(tokens.shape) < 0.1
        tokens = np.where(noise, rng.integers(0, VOCAB, tokens.shape), tokens)
        out.append(tokens.astype(np.uint32))
    return out


def optimizer(steps: int) -> optax.GradientTransformation:
    """Clipping, then AdamW on a warmup + cosine schedule; no decay on biases and norms."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=3e-3, warmup_steps=max(1, steps // 6), decay_steps=steps
    )

    def decay(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )


def initial_state(
    proof: zkdv.jax.ZKDV | None, steps: int = STEPS, blocks: int = BLOCKS, seed: int = 0
) -> Any:
    model = LM(blocks)
    params = model.init(jax.random.key(seed), jnp.zeros((1, CONTEXT), jnp.int32))["params"]
    return zkdv.jax.contrib.TrainState.create(
        proof=proof, apply_fn=model.apply, params=params, tx=optimizer(steps)
    )


def loss_and_grads(state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
    """Mean next-token loss and gradient over the step's micro-batches (accumulated)."""

    def loss(params: Any, micro: jax.Array) -> jax.Array:
        logits = state.apply_fn({"params": params}, micro[:, :-1].astype(jnp.int32))
        targets = micro[:, 1:].astype(jnp.int32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    micro = tokens.reshape(MICRO_BATCHES, MICRO_BATCH, CONTEXT + 1)
    total_loss = jnp.zeros(())
    total = jax.tree.map(jnp.zeros_like, state.params)
    for k in range(MICRO_BATCHES):
        value, grads = jax.value_and_grad(loss)(state.params, micro[k])
        total_loss = total_loss + value
        total = jax.tree.map(jnp.add, total, grads)
    scale = 1.0 / MICRO_BATCHES
    return total_loss * scale, jax.tree.map(lambda g: g * scale, total)


def train(
    proof: zkdv.jax.ZKDV, steps: int = STEPS, *, blocks: int = BLOCKS, seed: int = 0
) -> tuple[Any, list[float]]:
    """Train ``steps`` steps under ``proof`` (started), the initial parameters and the
    token stream drawn from ``seed``; returns the state and the losses."""
    state = initial_state(proof, steps, blocks, seed)

    @proof.jit(donate_argnums=(0,))
    def train_step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        loss, grads = loss_and_grads(state, tokens)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for tokens in token_batches(steps, seed):
        state, loss = train_step(state, jnp.asarray(tokens))
        losses.append(float(loss))
    return state, losses


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="zkdv-lm-")
    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.25))
    proof = zkdv.jax.ZKDV(os.path.join(path, "proof"), config, replay_snapshot_interval=8)
    proof.start(rolling_window=4, probe_ratio=0.25)
    _, losses = train(proof)
    proof.close()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    print(verify_transcript(proof.path).summary())
    try:
        from provers import jax_replay
        from provers.replay import Transcript, windows
    except ImportError:
        return
    transition = jax_replay.load_transition(proof.path)
    for first, last in windows(Transcript.load(proof.path)):
        verdict = jax_replay.verify_challenge(
            proof.path, first, through=last, transition=transition
        )
        print(f"platform replay of steps {first}-{last}: {'ok' if verdict.ok else verdict.message}")


if __name__ == "__main__":
    main()
