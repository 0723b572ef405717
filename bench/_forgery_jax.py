"""The forgery suite's attacks against the JAX LM recipe (``examples/jax/lm.py``).

``bench/forgery_suite.py --recipe jax`` runs these. The recipe trains as users train it:
Flax's transformer, Optax's clipping and AdamW on a warmup + cosine schedule, two
accumulated micro-batches inside the step, through ``zkdv.jax.ZKDV`` at the default
policy (``ZKDVConfig()``: sampled checks with p = 0.01) with a snapshot every 12 steps.
Each transcript meets what the platform applies: the SDK's own sampled check, the
offline verifier, and every window replayed by ``provers.jax_replay`` (within the
run's bounds, as a worker on other hardware replays it: ``forgery_suite.platform``);
the platform's draws then read the window verdicts (``forgery_suite.challenge``).

The attacks whose forger a JAX lab can mount:

* ``substitution-1``, ``-5``, ``-100``: steps trained on another corpus's batch while a
  modified SDK commits the real one (the batch the step program hands the SDK is swapped
  before it is hashed);
* ``hidden-steps``: 1 % more steps trained between committed ones by the same step
  function jitted without the SDK (whose refusal of a state that does not continue the
  last committed one, ``ZKDVVerificationError``, the forger's SDK skips);
* ``tokens-underreported``: a modified SDK commits half of each step's token count.

Not here, and why: in JAX the SDK commits the whole step program, gradient and optimizer
together (``proof.jit``), so a forger cannot edit the gradient outside the committed
program as the Torch spoof and tolerance-gap forgers do; a spoof written *into* the step
function is the program the certificate names and replays bit for bit (what a
certificate attests is that this program ran, and an auditor reads the program). A
fine-tune filed as pre-training and refilings are platform matters, framework-free:
the Torch rows stand for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import zkdv
import zkdv.jax
from tests.agent.zkdv.jax.recipes import example
from zkdv.jax import forgery
from zkdv.verify import verify_transcript

lm = example("lm")
SNAPSHOT_INTERVAL = 12
ATTACKS = (
    "substitution-1",
    "substitution-5",
    "substitution-100",
    "hidden-steps",
    "tokens-underreported",
)


@dataclass
class JaxForger:
    """What a forger changes in the JAX recipe's loop."""

    #: steps trained on another corpus's batch while the real one is committed
    substituted: frozenset[int] = frozenset()
    #: steps after which one step is trained off the transcript
    hidden_after: frozenset[int] = frozenset()
    #: factor on the token count the SDK commits
    token_factor: float = 1.0


@contextmanager
def _modified_sdk(forger: JaxForger, committed: dict[int, np.ndarray]) -> Iterator[None]:
    """The forger's changes to ``zkdv.jax`` (:mod:`zkdv.jax.forgery`), undone afterwards.

    The step program hands the SDK the batch it trained on (packed, as the batch file
    holds it); a substituting forger swaps in the real batch before it is hashed.
    """
    with ExitStack() as changes:
        if forger.substituted:
            changes.enter_context(forgery.committed_batches(committed))
        if forger.token_factor != 1.0:
            changes.enter_context(forgery.scaled_tokens(forger.token_factor))
        if forger.hidden_after:
            # The unmodified SDK refuses a state that does not continue the last
            # committed one (ZKDVVerificationError); a forger's SDK does not.
            changes.enter_context(forgery.unchecked_continuity())
        yield


def _flat(params: Any) -> np.ndarray:
    return np.concatenate(
        [np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(params)]
    )


@dataclass
class JaxRun:
    path: Path
    wall: float
    initial: np.ndarray
    final: np.ndarray
    poisoned_at: int | None = None
    #: what stopped the run before the platform: the SDK's sampled check or continuity
    refused_by: str = ""


def train(
    path: Path,
    *,
    steps: int,
    seed: int,
    forger: JaxForger | None = None,
    step_of: Callable[[str], int],
) -> JaxRun:
    """The JAX LM recipe (``examples/jax/lm.py``'s ``train``), with ``forger``'s changes.

    ``step_of`` reads the step an SDK error names (``forgery_suite._step_of``).
    """
    forger = forger or JaxForger()
    real = lm.token_batches(steps, seed + 1)
    other = lm.token_batches(steps, seed + 7919)
    off_book = iter(lm.token_batches(steps, seed + 104729))
    # What the SDK hashes for a substituted step: the real batch, as the program packs it.
    committed = {i: np.ascontiguousarray(real[i], dtype=np.uint32) for i in forger.substituted}
    started = time.perf_counter()
    proof = zkdv.jax.ZKDV(path, zkdv.ZKDVConfig(), replay_snapshot_interval=SNAPSHOT_INTERVAL)
    proof.start(rolling_window=8, probe_ratio=0.05)
    state = lm.initial_state(proof, steps, lm.BLOCKS, seed)
    initial = _flat(state.params)

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        loss, grads = lm.loss_and_grads(state, tokens)
        return state.apply_gradients(grads=grads), loss

    attested = proof.jit(step, donate_argnums=(0,))
    unrecorded = jax.jit(step)  # the same step, off the transcript
    run = JaxRun(path, 0.0, initial, initial)
    try:
        with _modified_sdk(forger, committed):
            for index in range(steps):
                tokens = other[index] if index in forger.substituted else real[index]
                state, _ = attested(state, jnp.asarray(tokens))
                if index in forger.hidden_after:
                    state, _ = unrecorded(state, jnp.asarray(next(off_book)))
            proof.close()
    except zkdv.ZKDVError as error:
        # The SDK's own sampled check, or its refusal of a state that does not continue
        # the last committed one (both poison the run).
        continuity = "modified outside a proof.jit step" in str(error)
        run.poisoned_at = step_of(str(error))
        run.refused_by = "SDK: continuity" if continuity else "sampled check"
    run.wall = time.perf_counter() - started
    run.final = _flat(state.params) if run.poisoned_at is None else initial
    return run


def forger_for(
    attack: str, *, steps: int, seed: int, weakest: Callable[[int, int, int], frozenset[int]]
) -> tuple[JaxForger, int]:
    """The forger of ``attack`` and how many steps it forges."""
    if attack.startswith("substitution-"):
        count = max(1, -(-int(attack.split("-")[1]) * steps // 100))
        return JaxForger(substituted=weakest(steps, count, seed)), count
    if attack == "hidden-steps":
        count = max(1, -(-steps // 100))
        return JaxForger(hidden_after=weakest(steps, count, seed)), count
    if attack == "tokens-underreported":
        return JaxForger(token_factor=0.5), steps
    raise ValueError(f"unknown JAX attack {attack!r}; choose from {', '.join(ATTACKS)}")


def committed_tokens(path: Path) -> int:
    return int(verify_transcript(path).tokens)
