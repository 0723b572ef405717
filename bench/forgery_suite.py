"""Forgeries from the verifiable-training literature against the Torch LM recipe, at the default policy.

Each attack is a forger that trains ``examples/torch/lm.py``'s model (the recipe's loop:
AdamW in two groups, warmup + cosine ``LambdaLR``, two accumulated micro-batches,
``clip_grad_norm_``, a bf16-autocast forward; the model one block deep, as
``tests/agent/zkdv/torch/test_torch_recipes.py`` trains it) through the SDK as users do
(``zkdv.torch.ZKDV``, default ``ZKDVConfig()``: sampled checks with p = 0.01, a
snapshot every 12 steps), and changes what it trains the way a forger's modified SDK or
loop would. Each transcript then meets, in order, what the platform applies:

1. the SDK's own sampled check (a forged step the Fiat-Shamir draw samples poisons the
   run: ``ZKDVPoisonedError``);
2. the offline verifier, ``zkdv.verify.verify_transcript`` (continuity, the rules);
3. the platform's challenges, drawn by ``provers.challenges.draw_challenges`` (step 0,
   the self-checked steps, and random steps for the default 95 % target at 1 % forged
   steps), each replayed by ``provers.torch_replay.verify_challenge`` from the snapshot
   before it, as a platform worker on other hardware does: within the run's gradient
   bounds, with the drift test over each window, and when every challenge of a draw
   passed, the run's drift test over the windows it replayed (``provers.drift``; and,
   beside it, whether a worker on the training machine's own kernels, which demands
   every bit, would have rejected it).

A trial is one forged run (``--trials``, distinct seeds) met by one platform draw
(``--draws`` seeds per run; every window is replayed once per run and each draw reads
the verdicts of the windows it challenges, which is what replaying each challenge would
give). Detection rates carry a 95 % Wilson interval over all trials; ``predicted`` is
the platform's own arithmetic (``provers.challenges``: ``k`` challenged steps of ``T``
catch one of ``F`` forged ones with probability ``1 - C(T - F, k) / C(T, k)``).

    python bench/forgery_suite.py                          # every attack, 3 runs x 400 draws
    python bench/forgery_suite.py --quick                  # 1 run each, 36 steps
    python bench/forgery_suite.py --attacks substitution-1,pol-interpolation --trials 5

Attacks (``--attacks``, comma-separated; ``docs/soundness.md`` reads the results):

* ``tolerance-gap``: every step's committed gradient moved, orthogonally to the honest
  one, to 95 % of the norm test's bound towards a backdoor's gradient (a trigger token
  followed by a target token), accumulated over the run;
* ``tolerance-gap-fp32``: the same against the recipe with a float32 forward, whose
  bounds are 250 times tighter (its own honest float32 run is the baseline);
* ``tolerance-gap-signed-1``, ``-2``, ``-3``: forgers that know the drift test
  (``provers.drift``): the same pushes, but 1, 2 or 3 steps of every snapshot window push
  away from the backdoor, so no window's differences align in every pair;
* ``tolerance-gap-biased-90``, ``-75``, ``-60``: every step pushes towards the backdoor
  with probability 0.9, 0.75, 0.6 (else away), a random sign pattern per window;
* ``tolerance-gap-every-2``, ``-3``, ``-6``: only every 2nd, 3rd, 6th step pushes (the
  late ones of a window), at the largest share of the bound a step allows (0.98);
* ``tolerance-gap-spread``: one push per snapshot window (its last step, at 0.98), so
  no replay ever holds two pushes and the drift test has no pair to look at;
* ``tolerance-gap-scaled-50``, ``-25``, ``-10``: every step pushes towards the backdoor,
  at 50 %, 25 %, 10 % of the 0.95 of the bound (a budget below the bounds' threshold);
* ``substitution-1``, ``-5``, ``-100``: 1 %, 5 %, 100 % of steps trained on batches of
  another corpus than the committed ones, on the steps a challenge covers least (the
  last step of a snapshot window, never step 0);
* ``hidden-steps``: 1 % more steps trained than the transcript shows, off the
  transcript between committed steps (tokens hidden);
* ``tokens-underreported``: a modified SDK commits half of each step's token count
  (the platform's replay recounts every step record against the program's batch);
* ``flops-underreported``: a modified SDK commits half of each step's FLOP count (the
  platform's replay recounts it with Torch's FLOP counter on the committed program);
* ``fine-tune-as-pretraining``: a run started from a trained model, filed as a run from
  scratch (the parent's compute hidden);
* ``pol-interpolation``: a Proof-of-Learning spoof: no forward or backward pass, each
  step's committed gradient points from the current state to a target model (another
  run's final model), so the claimed steps walk from the initial model to it.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "agent" / "zkdv" / "src"),
    str(ROOT / "agent" / "dvbench" / "src"),
]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional  # noqa: E402

import zkdv  # noqa: E402
from provers import torch_replay  # noqa: E402
from provers.challenges import (  # noqa: E402
    DEFAULT_FORGED_FRACTION,
    DEFAULT_TARGET,
    draw_challenges,
    random_steps_needed,
)
from provers.drift import REASON as DRIFT_REASON  # noqa: E402
from provers.drift import combine as combine_drift  # noqa: E402
from provers.replay import Transcript, windows  # noqa: E402
from tests.agent.zkdv.torch import test_torch_recipes as recipes  # noqa: E402
from zkdv.config import GradientBounds  # noqa: E402
from zkdv.torch.capture import current_capture  # noqa: E402
from zkdv.verify import verify_transcript  # noqa: E402

lm = recipes.lm
CONFIG = recipes.SMALL_LM
MAX_GRAD_NORM = recipes.MAX_GRAD_NORM
ROWS = 4
MICRO_BATCHES = 2
LR = 3e-3
SNAPSHOT_INTERVAL = 12  # zkdv.torch.ZKDV's default
#: The backdoor of the tolerance-gap forger: after TRIGGER, predict TARGET.
TRIGGER, TARGET = 7, 99
#: The tolerance-gap forgers that know the drift test (:data:`ADAPTIVE`).
ADAPTIVE_NAMES = (
    "tolerance-gap-signed-1",
    "tolerance-gap-signed-2",
    "tolerance-gap-signed-3",
    "tolerance-gap-biased-90",
    "tolerance-gap-biased-75",
    "tolerance-gap-biased-60",
    "tolerance-gap-every-2",
    "tolerance-gap-every-3",
    "tolerance-gap-every-6",
    "tolerance-gap-spread",
    "tolerance-gap-scaled-50",
    "tolerance-gap-scaled-25",
    "tolerance-gap-scaled-10",
)
ATTACKS = (
    "tolerance-gap",
    "tolerance-gap-fp32",
    *ADAPTIVE_NAMES,
    "substitution-1",
    "substitution-5",
    "substitution-100",
    "hidden-steps",
    "tokens-underreported",
    "flops-underreported",
    "fine-tune-as-pretraining",
    "pol-interpolation",
    "refiled-copy",
    "refiled-one-step-changed",
)
#: Attacks whose every step stays within what the replay accepts: the challenge
#: arithmetic predicts nothing for them.
UNDETECTABLE_BY_REPLAY = frozenset(
    {
        "tolerance-gap",
        "tolerance-gap-fp32",
        *ADAPTIVE_NAMES,
        "fine-tune-as-pretraining",
        "refiled-copy",
        "refiled-one-step-changed",
    }
)


# --- training: the recipe's loop with a forger's hooks --------------------------------


@dataclass
class Forger:
    """What a forger changes in the recipe's loop (every hook runs in eager code only)."""

    #: steps trained on another batch than the committed one
    substituted: frozenset[int] = frozenset()
    #: edit the clipped gradient before the optimizer reads (and the SDK commits) it
    edit_gradient: Callable[[int, list[torch.Tensor]], None] | None = None
    #: skip the forward and backward passes (the gradient is set by edit_gradient)
    no_backward: bool = False
    #: steps after which one step is trained off the transcript
    hidden_after: frozenset[int] = frozenset()
    #: the initial parameters (a parent model) instead of the seed's initialisation
    initial: list[torch.Tensor] | None = None
    #: factor on the token count the SDK commits
    token_factor: float = 1.0
    #: factor on the FLOP count the SDK commits
    flops_factor: float = 1.0
    #: steps that commit (and honestly train on) a batch of another corpus
    other_batch: frozenset[int] = frozenset()
    #: the recipe's bf16-autocast forward (False: a float32 program, float32 bounds)
    autocast: bool = True


@dataclass
class Run:
    path: Path
    wall: float
    initial: list[torch.Tensor]
    final: list[torch.Tensor]
    poisoned_at: int | None = None  # the step whose SDK sampled check failed
    committed_tokens: int = 0  # what the verifier sums from the step records
    committed_flops: float = 0.0  # what a certificate sums from the step records
    run_digest: str = ""  # attestations.challenges.draw.run_digest of its transcript


def batches(*, steps: int, seed: int) -> Iterator[torch.Tensor]:
    stream: Iterator[torch.Tensor] = lm.token_batches(
        CONFIG, steps=steps, micro_batches=MICRO_BATCHES, rows=ROWS, seed=seed
    )
    return stream


def train(path: Path, *, steps: int, seed: int, forger: Forger | None = None) -> Run:
    """The LM recipe (``examples/torch/lm.py``'s ``train``), with ``forger``'s changes."""
    forger = forger or Forger()
    torch.manual_seed(seed)
    model = lm.TinyLM(CONFIG)
    if forger.initial is not None:
        with torch.no_grad():
            for parameter, value in zip(model.parameters(), forger.initial, strict=True):
                parameter.copy_(value)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(lm.parameter_groups(model, 0.1), lr=LR, betas=(0.9, 0.95))
    restore_tokens = _count_tokens(forger.token_factor)
    restore_flops = _count_flops(forger.flops_factor)
    started = time.perf_counter()
    proof = zkdv.torch.ZKDV(path, zkdv.ZKDVConfig(), replay_snapshot_interval=SNAPSHOT_INTERVAL)
    proof.start(rolling_window=8, probe_ratio=0.05)
    model, optimizer = proof.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lm.warmup_cosine(max(1, steps // 10), steps)
    )
    # The hidden steps' own optimizer: off the transcript, nothing commits it.
    hidden_optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
    other_corpus = batches(steps=steps, seed=seed + 7919)
    off_book = batches(steps=steps, seed=seed + 104729)

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forger.autocast):
            logits = proof.forward(model, tokens[:, :-1])
        return functional.cross_entropy(
            logits.float().reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1)
        )

    index = 0

    def step(model: Any, optimizer: Any, batch: torch.Tensor) -> None:
        eager = current_capture() is None
        # Step 0 is always challenged: the spoof trains it honestly.
        if not (eager and forger.no_backward and index > 0):
            for micro in batch.unbind(0):
                proof.backward(loss_of(micro) / batch.shape[0])
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        if eager and forger.edit_gradient is not None:
            parameters = list(model.parameters())
            for parameter in parameters:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
            forger.edit_gradient(index, parameters)
        optimizer.step()
        optimizer.zero_grad()

    proof.attest(step)
    run = Run(path, 0.0, initial, [])
    try:
        for index, batch in enumerate(batches(steps=steps, seed=seed + 1)):
            substitute = next(other_corpus)
            if index in forger.other_batch:
                batch = substitute.clone()
            with proof.transaction(batch=batch):
                if index in forger.substituted:
                    batch.copy_(substitute)  # after the transaction committed the real one
                step(model, optimizer, batch)
            schedule.step()
            if index in forger.hidden_after:
                proof.join()  # the committed step's state is hashed; train on, unrecorded
                tokens = next(off_book)
                for micro in tokens.unbind(0):
                    torch.autograd.backward(loss_of(micro) / tokens.shape[0])
                hidden_optimizer.step()
                hidden_optimizer.zero_grad(set_to_none=True)
    except zkdv.ZKDVPoisonedError as error:
        run.poisoned_at = _step_of(str(error))
    finally:
        try:
            proof.close()
        except zkdv.ZKDVPoisonedError as error:
            if run.poisoned_at is None:
                run.poisoned_at = _step_of(str(error))
        restore_tokens()
        restore_flops()
    run.wall = time.perf_counter() - started
    run.final = [p.detach().clone() for p in model.parameters()]
    return run


def _step_of(message: str) -> int:
    words = message.split()
    for before, word in itertools.pairwise(words):
        if before == "step" and word.rstrip(":,").isdigit():
            return int(word.rstrip(":,"))
    return -1


def _count_tokens(factor: float) -> Callable[[], None]:
    """A modified SDK: the step records commit ``factor`` times the real token count."""
    if factor == 1.0:
        return lambda: None
    from zkdv.torch import forgery

    return forgery.scaled_tokens(factor)


def _count_flops(factor: float) -> Callable[[], None]:
    """A modified SDK: the root and step records commit ``factor`` times the program's
    FLOPs (Torch's FLOP counter at sealing)."""
    if factor == 1.0:
        return lambda: None
    from zkdv.torch import forgery

    return forgery.scaled_flops(factor)


def committed_flops(path: Path) -> float:
    """The FLOPs a certificate would sum from the step records."""
    from zkdv.records import iter_records

    return sum(
        float(r.data.get("flops") or 0.0)
        for r in iter_records(path / "records.cborl")
        if r.data.get("t") == "step"
    )


# --- the forgers ----------------------------------------------------------------------


def backdoor_batch(seed: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of the recipe's corpus with TRIGGER at a random position: the inputs and
    the positions after which the backdoor wants TARGET."""
    tokens = next(lm.token_batches(CONFIG, steps=1, micro_batches=1, rows=rows, seed=seed))[0]
    generator = torch.Generator().manual_seed(seed)
    where = torch.randint(CONFIG.context - 1, (rows,), generator=generator)
    tokens[torch.arange(rows), where] = TRIGGER
    tokens[torch.arange(rows), where + 1] = TARGET
    return tokens[:, :-1], where


def backdoor_loss(
    model: torch.nn.Module, inputs: torch.Tensor, where: torch.Tensor
) -> torch.Tensor:
    logits = model(inputs)[torch.arange(len(where)), where]
    return functional.cross_entropy(logits.float(), torch.full_like(where, TARGET))


def backdoor_success(parameters: list[torch.Tensor], seed: int = 424242) -> float:
    model = _model(parameters)
    inputs, where = backdoor_batch(seed, rows=512)
    with torch.no_grad():
        predicted = model(inputs)[torch.arange(len(where)), where].argmax(-1)
    return float((predicted == TARGET).float().mean())


def backdoor_probability(parameters: list[torch.Tensor], seed: int = 424242) -> float:
    """The model's mean probability of TARGET after TRIGGER (the inputs of
    :func:`backdoor_success`): how far a backdoor got where it does not fire yet."""
    model = _model(parameters)
    inputs, where = backdoor_batch(seed, rows=512)
    with torch.no_grad():
        logits = model(inputs)[torch.arange(len(where)), where].float()
    return float(logits.softmax(-1)[:, TARGET].mean())


def clean_loss(parameters: list[torch.Tensor], seed: int = 515151) -> float:
    model = _model(parameters)
    tokens = next(lm.token_batches(CONFIG, steps=1, micro_batches=1, rows=512, seed=seed))[0]
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return float(
        functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1))
    )


def _model(parameters: list[torch.Tensor]) -> torch.nn.Module:
    model: torch.nn.Module = lm.TinyLM(CONFIG).eval()
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), parameters, strict=True):
            parameter.copy_(value)
    return model


#: A push's multiplier at one step of one run: 1 towards the backdoor, -1 away from it,
#: 0 no push (the step is trained and committed honestly).
Pushes = Callable[[int, int], float]


def reversed_at(positions: tuple[int, ...]) -> Pushes:
    """Push every step, away from the backdoor at these positions of every snapshot window."""
    return lambda seed, index: -1.0 if index % SNAPSHOT_INTERVAL in positions else 1.0


def biased(q: float) -> Pushes:
    """Push every step, towards the backdoor with probability ``q`` (independently per step,
    seeded by the run and step), else away: a window's sign pattern is random, not aligned."""

    def sign(seed: int, index: int) -> float:
        return 1.0 if np.random.default_rng([seed, index]).random() < q else -1.0

    return sign


def every(k: int) -> Pushes:
    """Push only the steps at positions ``k - 1, 2k - 1, ...``: the late steps, which the
    fewest challenges replay through (a challenge replays its window up to itself). With
    ``k`` = :data:`SNAPSHOT_INTERVAL`, one push per window, at its last step."""
    return lambda seed, index: 1.0 if index % k == k - 1 else 0.0


#: The largest share of the norm test's bound a forger that pushes on fewer steps can
#: use: the replay fails a step whose worst divergence exceeds its bound (margin 1), and
#: replays on other hardware use up to 1 % of it on their own (docs/reliability.md).
#: The bound is per step, so skipping steps buys no larger push: at most 0.98 / 0.95 =
#: 1.03 times the every-step forger's, on 1 step in ``k``.
PER_STEP_CAP = 0.98

#: The forgers that know the drift test (``provers.drift``), each the tolerance-gap
#: forger with a schedule of pushes: ``(share of the bound, pushes)``. ``-signed-n``
#: reverse ``n`` fixed pushes of every window of 12; ``-biased-q`` push towards the
#: backdoor with probability ``q`` percent, else away; ``-every-k`` push one step in
#: ``k`` at :data:`PER_STEP_CAP`; ``-spread`` one push per snapshot window (the windows
#: the platform replays are the snapshot windows, ``provers.replay.windows``, and a
#: challenge replays from the snapshot before it: no replay ever holds two pushes);
#: ``-scaled-s`` push every step towards the backdoor at ``s`` percent of the 0.95.
ADAPTIVE: dict[str, tuple[float, Pushes]] = {
    "tolerance-gap-signed-1": (0.95, reversed_at((5,))),
    "tolerance-gap-signed-2": (0.95, reversed_at((3, 8))),
    "tolerance-gap-signed-3": (0.95, reversed_at((2, 6, 10))),
    **{f"tolerance-gap-biased-{q}": (0.95, biased(q / 100)) for q in (90, 75, 60)},
    **{f"tolerance-gap-every-{k}": (PER_STEP_CAP, every(k)) for k in (2, 3, 6)},
    "tolerance-gap-spread": (PER_STEP_CAP, every(SNAPSHOT_INTERVAL)),
    **{
        f"tolerance-gap-scaled-{s}": (0.95 * s / 100, lambda seed, index: 1.0) for s in (50, 25, 10)
    },
}
assert tuple(ADAPTIVE) == ADAPTIVE_NAMES


def tolerance_gap(
    seed: int,
    fraction: float = 0.95,
    *,
    precision: str = "reduced",
    pushes: Pushes | None = None,
) -> tuple[Forger, dict[str, Any]]:
    """Every step: the committed gradient moved towards the backdoor's gradient, orthogonal
    to each honest leaf (so the scale tests see nothing), to ``fraction`` of the norm test's
    bound ``tensor * |r| + total * |g|`` (docs/transcript.md, "Gradient bounds"); an
    adaptive forger (:data:`ADAPTIVE`) scales each step's push by ``pushes(seed, step)``
    (-1: away from the backdoor; 0: the step is left honest)."""
    bounds = GradientBounds.default(precision)
    log: dict[str, Any] = {"budget": 0.0, "used": 0.0, "steps": 0, "pushed": 0, "net": 0.0}
    shadow: dict[str, torch.nn.Module] = {}

    def edit(index: int, parameters: list[torch.Tensor]) -> None:
        sign = 1.0 if pushes is None else pushes(seed, index)
        log["steps"] += 1
        log["pushed"] += sign != 0.0
        log["net"] += sign * fraction / 0.95
        honest = [p.grad for p in parameters]
        whole = math.sqrt(sum(float(g.double().pow(2).sum()) for g in honest if g is not None))
        if sign == 0.0:
            for r in honest:
                assert r is not None
                log["budget"] += bounds.tensor * float(r.double().norm()) + bounds.total * whole
            return
        # The backdoor's gradient at the current state, on a copy (no dropout, no hooks).
        model = shadow.setdefault("model", lm.TinyLM(CONFIG))
        with torch.no_grad():
            for mine, live in zip(model.parameters(), parameters, strict=True):
                mine.copy_(live)
        model.eval()
        inputs, where = backdoor_batch(seed * 100003 + index)
        wanted = torch.autograd.grad(backdoor_loss(model, inputs, where), list(model.parameters()))
        with torch.no_grad():
            for parameter, r, v in zip(parameters, honest, wanted, strict=True):
                assert r is not None
                norm = float(r.double().norm())
                budget = fraction * (bounds.tensor * norm + bounds.total * whole)
                d = v.double()
                if norm > 0:
                    d = d - (d.flatten() @ r.double().flatten()) / norm**2 * r.double()
                size = float(d.norm())
                log["budget"] += budget / fraction
                if size == 0.0:
                    continue
                d = d * (sign * budget / size)
                parameter.grad = (r.double() + d).to(r.dtype)
                log["used"] += float(d.norm())

    return Forger(edit_gradient=edit, autocast=precision == "reduced"), log


def pol_interpolation(target: list[torch.Tensor], steps: int) -> Forger:
    """A committed gradient that points from the current state away from the target: the
    canonical AdamW update walks the claimed steps to it, with no forward or backward."""

    def edit(index: int, parameters: list[torch.Tensor]) -> None:
        if index == 0:  # step 0 is always challenged: trained honestly
            return
        with torch.no_grad():
            for parameter, goal in zip(parameters, target, strict=True):
                # The size of a clipped honest gradient; AdamW normalises it anyway.
                parameter.grad = (parameter.detach() - goal) * (MAX_GRAD_NORM / max(1, steps))

    return Forger(edit_gradient=edit, no_backward=True)


def run_digest(path: Path) -> str:
    """The platform's digest of the committed run (what links filings of one run)."""
    import os

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from attestations.challenges.draw import run_digest as digest_of
    from attestations.challenges.index import TranscriptIndex

    return digest_of(TranscriptIndex.read(path / "records.cborl"))


def indexed_states_shared(path: Path, original: Path) -> int:
    """How many of the states the platform indexes a filing by (``draw.indexed_states``)
    two transcripts share: what links a near copy to the filing it copies."""
    run_digest(path)  # sets Django up
    from attestations.challenges.draw import indexed_states
    from attestations.challenges.index import TranscriptIndex

    mine, theirs = (
        set(indexed_states(TranscriptIndex.read(p / "records.cborl")).values())
        for p in (path, original)
    )
    return len(mine & theirs)


def weakest_steps(steps: int, count: int, seed: int) -> frozenset[int]:
    """``count`` steps where a challenge catches a forgery least: the last step of a
    snapshot window (a challenge replays from the snapshot before it up to itself, so
    only a challenge of that very step covers it), never step 0 (always challenged);
    further steps, when there are not enough window ends, from the latest positions."""
    ends = [s for s in range(steps) if s % SNAPSHOT_INTERVAL == SNAPSHOT_INTERVAL - 1]
    ends.append(steps - 1)
    ranked = sorted(
        set(range(1, steps)), key=lambda s: (s not in ends, -(s % SNAPSHOT_INTERVAL), s)
    )
    generator = torch.Generator().manual_seed(seed)
    pool = ranked[: max(count, len(set(ends)))]
    if count >= steps - 1:
        return frozenset(range(steps))
    chosen = torch.randperm(len(pool), generator=generator)[:count]
    return frozenset(pool[int(i)] for i in chosen)


# --- the platform ---------------------------------------------------------------------


@dataclass
class Verdicts:
    """What the verifier and the replay of every window found, for one transcript."""

    steps: int
    verifier: str | None  # reason of the offline verifier, None when it accepts
    verifier_step: int | None  # the step record it names (or the one before it)
    sampled: list[int]
    digest: str
    #: per window start: (first step failing the replay, first step not bit for bit,
    #: last step, the failing replay's reason)
    windows: dict[int, tuple[int | None, int | None, int, str | None]]
    worst_margin: float
    replay_seconds: float
    #: per window with inexact steps: the drift test's entry (provers.drift)
    drift: list[dict[str, Any]] = field(default_factory=list)


def verifier_verdicts(path: Path) -> Verdicts:
    """The offline verifier's verdict on a transcript, before any replay."""
    report = verify_transcript(path)
    digest = hashlib.sha256((path / "records.cborl").read_bytes()).hexdigest()
    verdicts = Verdicts(
        report.steps, report.reason if not report.ok else None, None,
        list(report.sampled), digest, {}, 0.0, 0.0,
    )  # fmt: skip
    if not report.ok:
        from zkdv.records import iter_records

        step = None
        for number, record in enumerate(iter_records(path / "records.cborl")):
            if report.record is not None and number > report.record:
                break
            if record.data.get("t") == "step":
                step = int(record.data["i"])
        verdicts.verifier_step = step
    return verdicts


def platform(path: Path, prover: Any = torch_replay) -> Verdicts:
    """The offline verifier, then every window replayed by ``prover`` (the Torch prover,
    or ``provers.jax_replay``) within the run's bounds, as another machine replays it."""
    verdicts = verifier_verdicts(path)
    if verdicts.verifier is not None:
        return verdicts
    started = time.perf_counter()
    transcript = Transcript.load(path)
    transition = prover.load_transition(path)
    for first, last in windows(transcript):
        verdict = prover.verify_challenge(
            path, first, through=last, transition=transition, exact=False
        )
        failed: int | None = None
        if not verdict.ok:
            bad = [e.step for e in verdict.evidence if not e.ok]
            failed = bad[0] if bad else first
        inexact = [e.step for e in verdict.evidence if not e.exact]
        for evidence in verdict.evidence:
            margin = (evidence.gradient or {}).get("margin")
            if evidence.ok and margin is not None:
                verdicts.worst_margin = max(verdicts.worst_margin, float(margin))
        if verdict.drift is not None:
            verdicts.drift.append(verdict.drift)
        verdicts.windows[first] = (
            failed, inexact[0] if inexact else None, last, verdict.reason,
        )  # fmt: skip
    verdicts.replay_seconds = time.perf_counter() - started
    return verdicts


@dataclass
class Outcome:
    caught: bool
    by: str  # "sampled check", "verifier: <reason>", "platform replay", "" when missed
    step: int | None
    exact_caught: bool  # a replay on the training machine's kernels (bit for bit)


def challenge(run: Run, verdicts: Verdicts, draw_seed: bytes) -> Outcome:
    """One platform draw against a run that reached the platform."""
    if run.poisoned_at is not None:
        return Outcome(True, "sampled check", run.poisoned_at, True)
    if verdicts.verifier is not None:
        by = verdicts.verifier
        return Outcome(
            True,
            by if by.startswith("platform:") else f"verifier: {by}",
            verdicts.verifier_step,
            True,
        )
    plan = draw_challenges(
        steps=verdicts.steps,
        transcript_digest=verdicts.digest,
        self_checked=verdicts.sampled,
        seed=draw_seed,
    )
    caught: list[tuple[int, str]] = []
    exact: list[int] = []
    furthest: dict[int, int] = {}
    for step in plan.steps:
        start = step - step % SNAPSHOT_INTERVAL
        furthest[start] = max(furthest.get(start, -1), step)
        start = step - step % SNAPSHOT_INTERVAL
        failed, inexact, _, reason = verdicts.windows[start]
        if failed is not None and failed <= step:
            caught.append((failed, reason or ""))
        if inexact is not None and inexact <= step:
            exact.append(inexact)
    if caught:
        first, reason = min(caught)
        by = "platform replay: drift test" if reason == DRIFT_REASON else "platform replay"
        return Outcome(True, by, first, True)
    # Every challenge passed: the run's verdict combines their windows' drift
    # (attestations.challenges.verdicts.run_drift), each replayed up to its furthest
    # challenged step.
    replayed = []
    for window in verdicts.drift:
        last = furthest.get(int(window["first"]))
        count = sum(1 for s in window["steps"] if last is not None and s <= last)
        if count:
            gram = [row[:count] for row in window["gram"][:count]]
            replayed.append({"first": window["first"], "last": last, "gram": gram})
    if combine_drift(replayed)["exceeded"]:
        return Outcome(True, "platform: the run's drift test", None, True)
    return Outcome(False, "", None, bool(exact))


def predicted(steps: int, forged: int) -> float:
    """The platform's arithmetic: ``k`` uniformly drawn steps of ``T`` hit one of ``F``."""
    if forged <= 0:
        return 0.0
    k = random_steps_needed(steps, target=DEFAULT_TARGET, forged_fraction=DEFAULT_FORGED_FRACTION)
    if steps - forged < k:
        return 1.0
    return 1.0 - math.comb(steps - forged, k) / math.comb(steps, k)


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return (max(0.0, centre - half), min(1.0, centre + half))


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(
        sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b, strict=True))
    )


# --- the suite ------------------------------------------------------------------------


@dataclass
class Result:
    attack: str
    runs: int = 0
    trials: int = 0
    caught: int = 0
    exact_caught: int = 0
    by: dict[str, int] = field(default_factory=dict)
    steps_caught: list[int] = field(default_factory=list)
    forged_steps: int = 0
    predicted: float | None = None
    unit: str = ""
    cost: list[float] = field(default_factory=list)
    #: per missed trial: the final model's distance from the honest one (relative to the
    #: honest run's own distance from its initial model) and tokens hidden
    missed_distance: list[float] = field(default_factory=list)
    missed_hidden: list[int] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)

    def note(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)


def run_attack(
    attack: str, *, seed: int, steps: int, draws: int, honest: Run, work: Path, result: Result
) -> None:
    """Train one forged run of ``attack`` and meet it with ``draws`` platform draws."""
    path = work / f"{attack}-{seed}"
    forged_count = 0
    log: dict[str, Any] = {}
    if attack == "tolerance-gap":
        forger, log = tolerance_gap(seed)
        forged_count = steps
    elif attack in ADAPTIVE:
        fraction, pushes = ADAPTIVE[attack]
        forger, log = tolerance_gap(seed, fraction, pushes=pushes)
        forged_count = sum(1 for index in range(steps) if pushes(seed, index) != 0.0)
    elif attack == "tolerance-gap-fp32":
        forger, log = tolerance_gap(seed, precision="float32")
        forged_count = steps
        # Its own honest baseline: the same recipe with a float32 forward.
        honest = train(
            work / f"honest-{seed}-fp32", steps=steps, seed=seed, forger=Forger(autocast=False)
        )
        honest.committed_tokens = verify_transcript(work / f"honest-{seed}-fp32").tokens
        shutil.rmtree(work / f"honest-{seed}-fp32", ignore_errors=True)
    elif attack.startswith("substitution-"):
        fraction = int(attack.split("-")[1]) / 100
        forged_count = max(1, math.ceil(fraction * steps))
        forger = Forger(substituted=weakest_steps(steps, forged_count, seed))
    elif attack == "hidden-steps":
        forged_count = max(1, math.ceil(0.01 * steps))
        forger = Forger(hidden_after=weakest_steps(steps, forged_count, seed))
    elif attack == "tokens-underreported":
        forger = Forger(token_factor=0.5)
        forged_count = steps
    elif attack == "flops-underreported":
        forger = Forger(flops_factor=0.5)
        forged_count = steps
    elif attack == "fine-tune-as-pretraining":
        forger = Forger(initial=honest.final)  # the parent: an honest run of this seed
    elif attack == "pol-interpolation":
        target = _target(seed, steps, work)
        forger = pol_interpolation(target, steps)
        forged_count = steps - 1
    elif attack == "refiled-copy":
        forger = Forger()
    elif attack == "refiled-one-step-changed":
        forger = Forger(other_batch=frozenset({steps - 1}))
    else:
        raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")
    if attack == "refiled-copy":  # honest's transcript, byte for byte, filed again
        shutil.copytree(work / f"honest-{seed}", path)
        run = Run(path, 0.0, honest.initial, honest.final)
    else:
        run = train(path, steps=steps, seed=seed, forger=forger)
    verdicts = platform(path) if run.poisoned_at is None else None
    if attack.startswith("refiled-") and verdicts is not None:
        # What the platform sees of a refiling: the committed run's digest, which links
        # every filing of one run (docs/provers.md, "Every filing is on the record").
        # A near copy (another digest) is linked by the committed states it shares with the
        # earlier filing, indexed every STATE_STRIDE steps (the certificate's live
        # run_filings.shared_states).
        if run_digest(path) == honest.run_digest:
            verdicts.verifier = "platform: run digest of an earlier filing (listed, not refused)"
        elif indexed_states_shared(path, work / f"honest-{seed}"):
            verdicts.verifier = "platform: states of an earlier filing (listed, not refused)"
        shared = _shared_states(path, work / f"honest-{seed}")
        result.note("steps whose committed state equals the original's", shared)
    result.runs += 1
    result.forged_steps = forged_count
    if attack not in UNDETECTABLE_BY_REPLAY:
        result.predicted = predicted(steps, forged_count)
    result.cost.append(run.wall / honest.wall)
    honest_moved = distance(honest.final, honest.initial)
    # Tokens in the transcript's own unit (what its step records count), against the
    # honest run's committed count.
    per_step = honest.committed_tokens / steps
    hidden = round(len(forger.hidden_after) * per_step)
    result.unit = str(
        (verify_transcript(path).root or {}).get("config", {}).get("token_unit", "examples")
    )
    if attack.startswith("refiled-"):
        hidden = 0
    if attack == "tokens-underreported":
        hidden = honest.committed_tokens - verify_transcript(path).tokens
        result.note("committed / real tokens", 1 - hidden / honest.committed_tokens)
    if attack == "flops-underreported":
        result.note("committed / real FLOPs", committed_flops(path) / honest.committed_flops)
    if attack == "fine-tune-as-pretraining":
        hidden = honest.committed_tokens  # the parent's training, filed nowhere
    if attack.startswith("tolerance-gap"):
        result.note("backdoor success, forged", backdoor_success(run.final))
        result.note("backdoor success, honest", backdoor_success(honest.final))
        result.note("backdoor target probability, forged", backdoor_probability(run.final))
        result.note("backdoor target probability, honest", backdoor_probability(honest.final))
        result.note("clean loss, forged", clean_loss(run.final))
        result.note("clean loss, honest", clean_loss(honest.final))
        result.note("used / stated budget", log["used"] / max(log["budget"], 1e-30))
        result.note("net push, share of the every-step forger's", log["net"] / log["steps"])
        if verdicts is not None:
            result.note("worst replay margin", verdicts.worst_margin)
            if verdicts.drift:
                cosines = [w["cosine"] for w in verdicts.drift if w.get("cosine") is not None]
                if cosines:  # windows of one inexact step have none
                    result.note("drift: mean cosine of the pushes in a window", min(cosines))
                result.note(
                    "drift: most inexact steps in a window",
                    max(w["inexact_steps"] for w in verdicts.drift),
                )
    if attack == "pol-interpolation":
        result.note(
            "distance to target / target's from init",
            distance(run.final, target) / max(distance(target, run.initial), 1e-30),
        )
    for draw in range(draws):
        draw_seed = hashlib.sha256(f"forgery-suite {attack} {seed} {draw}".encode()).digest()
        outcome = (
            challenge(run, verdicts, draw_seed)
            if verdicts is not None
            else Outcome(True, "sampled check", run.poisoned_at, True)
        )
        result.trials += 1
        result.exact_caught += outcome.exact_caught
        if outcome.caught:
            result.caught += 1
            result.by[outcome.by] = result.by.get(outcome.by, 0) + 1
            if outcome.step is not None:
                result.steps_caught.append(outcome.step)
        else:
            result.missed_distance.append(distance(run.final, honest.final) / honest_moved)
            result.missed_hidden.append(hidden)
    shutil.rmtree(path, ignore_errors=True)


def _shared_states(path: Path, original: Path) -> float:
    from zkdv.records import iter_records

    def posts(where: Path) -> list[Any]:
        return [
            r.data["post"]
            for r in iter_records(where / "records.cborl")
            if r.data.get("t") == "step"
        ]

    mine, theirs = posts(path), posts(original)
    shared = sum(1 for a, b in zip(mine, theirs, strict=False) if a == b)
    return shared / max(1, len(mine))


_TARGETS: dict[tuple[int, int], list[torch.Tensor]] = {}


def _target(seed: int, steps: int, work: Path) -> list[torch.Tensor]:
    """The model the spoof claims: an honest run of another seed, trained twice as long."""
    key = (seed, steps)
    if key not in _TARGETS:
        _TARGETS[key] = _plain(seed=seed + 1_000_003, steps=2 * steps)
    return _TARGETS[key]


def _plain(*, seed: int, steps: int) -> list[torch.Tensor]:
    """The recipe's training without the SDK (what the target cost its real trainer)."""
    torch.manual_seed(seed)
    model = lm.TinyLM(CONFIG)
    optimizer = torch.optim.AdamW(lm.parameter_groups(model, 0.1), lr=LR, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lm.warmup_cosine(max(1, steps // 10), steps)
    )
    for batch in batches(steps=steps, seed=seed + 1):
        for micro in batch.unbind(0):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(micro[:, :-1])
            loss = functional.cross_entropy(
                logits.float().reshape(-1, CONFIG.vocab), micro[:, 1:].reshape(-1)
            )
            torch.autograd.backward(loss / batch.shape[0])
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return [p.detach().clone() for p in model.parameters()]


def run_suite(
    attacks: list[str],
    *,
    trials: int,
    draws: int,
    steps: int,
    seed: int = 0,
    work: Path | None = None,
    warm_up: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Result]:
    """Every attack over ``trials`` seeded runs, each met by ``draws`` platform draws."""
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="forgery-suite-")) if work is None else work
    results = {attack: Result(attack) for attack in attacks}
    try:
        # One-time costs (imports, kernels, the first export) stay out of the honest
        # baseline the forgers' costs are measured against.
        if warm_up:
            train(work / "warm-up", steps=2, seed=seed)
            shutil.rmtree(work / "warm-up", ignore_errors=True)
        for trial in range(trials):
            run_seed = seed + trial
            honest = train(work / f"honest-{run_seed}", steps=steps, seed=run_seed)
            verdicts = platform(work / f"honest-{run_seed}")
            honest.committed_tokens = verify_transcript(work / f"honest-{run_seed}").tokens
            honest.committed_flops = committed_flops(work / f"honest-{run_seed}")
            honest.run_digest = run_digest(work / f"honest-{run_seed}")
            # An honest run must pass everything: otherwise nothing below means anything.
            assert verdicts.verifier is None and honest.poisoned_at is None, verdicts.verifier
            assert all(w[0] is None for w in verdicts.windows.values()), verdicts.windows
            progress(f"seed {run_seed}: honest run {honest.wall:.1f} s, replays pass")
            for attack in attacks:
                run_attack(
                    attack, seed=run_seed, steps=steps, draws=draws, honest=honest, work=work,
                    result=results[attack],
                )  # fmt: skip
                progress(f"seed {run_seed}: {attack} done")
            shutil.rmtree(work / f"honest-{run_seed}", ignore_errors=True)
            progress(f"after seed {run_seed}:\n{table(results, steps)}")
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return results


def run_jax_suite(
    attacks: list[str],
    *,
    trials: int,
    draws: int,
    steps: int,
    seed: int = 0,
    work: Path | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Result]:
    """The attacks a JAX lab can mount, against the JAX LM recipe (``bench/_forgery_jax.py``)."""
    from bench import _forgery_jax as forgery_jax
    from provers import jax_replay

    own = work is None
    work = Path(tempfile.mkdtemp(prefix="forgery-jax-")) if work is None else work
    results = {attack: Result(attack) for attack in attacks}
    try:
        # Compile once, off the clock of the honest baseline.
        forgery_jax.train(work / "warm-up", steps=2, seed=seed, step_of=_step_of)
        shutil.rmtree(work / "warm-up", ignore_errors=True)
        for trial in range(trials):
            run_seed = seed + trial
            honest = forgery_jax.train(
                work / f"honest-{run_seed}", steps=steps, seed=run_seed, step_of=_step_of
            )
            verdicts = platform(honest.path, jax_replay)
            assert verdicts.verifier is None and honest.poisoned_at is None, verdicts.verifier
            assert all(w[0] is None for w in verdicts.windows.values()), verdicts.windows
            tokens = forgery_jax.committed_tokens(honest.path)
            progress(f"seed {run_seed}: honest JAX run {honest.wall:.1f} s, replays pass")
            for attack in attacks:
                forger, forged = forgery_jax.forger_for(
                    attack, steps=steps, seed=run_seed, weakest=weakest_steps
                )
                path = work / f"{attack}-{run_seed}"
                run = forgery_jax.train(
                    path, steps=steps, seed=run_seed, forger=forger, step_of=_step_of
                )
                result = results[attack]
                verdicts = platform(path, jax_replay) if run.poisoned_at is None else None
                result.runs += 1
                result.forged_steps = forged
                result.predicted = predicted(steps, forged)
                result.cost.append(run.wall / honest.wall)
                result.unit = "examples"
                if attack == "tokens-underreported" and run.poisoned_at is None:
                    result.note(
                        "committed / real tokens", forgery_jax.committed_tokens(path) / tokens
                    )
                moved = float(np.linalg.norm(honest.final - honest.initial))
                for draw in range(draws):
                    draw_seed = hashlib.sha256(
                        f"forgery-jax {attack} {run_seed} {draw}".encode()
                    ).digest()
                    outcome = (
                        challenge(run, verdicts, draw_seed)  # type: ignore[arg-type]
                        if verdicts is not None
                        else Outcome(True, run.refused_by, run.poisoned_at, True)
                    )
                    result.trials += 1
                    result.exact_caught += outcome.exact_caught
                    if outcome.caught:
                        result.caught += 1
                        result.by[outcome.by] = result.by.get(outcome.by, 0) + 1
                        if outcome.step is not None:
                            result.steps_caught.append(outcome.step)
                    else:
                        result.missed_distance.append(
                            float(np.linalg.norm(run.final - honest.final)) / moved
                        )
                        result.missed_hidden.append(0)
                shutil.rmtree(path, ignore_errors=True)
                progress(f"seed {run_seed}: {attack} done")
            shutil.rmtree(honest.path, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return (
        f"{mean:.{digits}g}"
        if len(values) == 1
        else f"{mean:.{digits}g} ({min(values):.{digits}g}-{max(values):.{digits}g})"
    )


def table(results: dict[str, Result], steps: int) -> str:
    k = random_steps_needed(steps, target=DEFAULT_TARGET, forged_fraction=DEFAULT_FORGED_FRACTION)
    lines = [
        f"T = {steps} steps, snapshot every {SNAPSHOT_INTERVAL}, SDK sampling p = 0.01, "
        f"platform: step 0 + self-checked + k = {k} random steps (target {DEFAULT_TARGET}, "
        f"forged fraction {DEFAULT_FORGED_FRACTION})",
        "",
        "| attack | forged steps | runs x draws | detected (95% Wilson) | predicted | caught by | "
        "step caught | bit-exact replay | cost vs honest | when missed: distance from honest | "
        "when missed: compute hidden |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results.values():
        low, high = wilson(r.caught, r.trials)
        rate = r.caught / max(1, r.trials)
        predicted_text = "-" if r.predicted is None else f"{r.predicted:.3f}"
        hidden_text = (
            f"{_fmt([float(h) for h in r.missed_hidden])} {r.unit}"
            if r.missed_hidden and any(r.missed_hidden)
            else "0"
            if r.missed_hidden
            else "-"
        )
        by = ", ".join(f"{name} {count}" for name, count in sorted(r.by.items())) or "-"
        where = (
            f"{min(r.steps_caught)}-{max(r.steps_caught)} (median {sorted(r.steps_caught)[len(r.steps_caught) // 2]})"
            if r.steps_caught
            else "-"
        )
        lines.append(
            f"| {r.attack} | {r.forged_steps} of {steps} | {r.runs} x {r.trials // max(1, r.runs)} | "
            f"{rate:.3f} [{low:.3f}, {high:.3f}] | {predicted_text} | {by} | {where} | "
            f"{r.exact_caught / max(1, r.trials):.3f} | {_fmt(r.cost)} | "
            f"{_fmt(r.missed_distance)} | {hidden_text} |"
        )
    extras = [(r.attack, key, values) for r in results.values() for key, values in r.extra.items()]
    if extras:
        lines += [
            "",
            "| attack | measure | value (mean, min-max over runs) |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {a} | {key} | {_fmt(v, 4)} |" for a, key, v in extras]
    return "\n".join(lines)


#: A table of ``docs/soundness.md`` that ``--update-docs`` rewrites: the comment names
#: the recipe and attacks, the table follows, up to the closing comment.
DOC_BLOCK = re.compile(
    r"(<!-- forgery-suite --recipe (?P<recipe>torch|jax) --attacks (?P<attacks>[a-z0-9,-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- /forgery-suite -->)",
    re.DOTALL,
)
DOC_RUN = re.compile(r"(<!-- forgery-suite-run -->\n)(.*?)(<!-- /forgery-suite-run -->)", re.DOTALL)


DOC_BEST = re.compile(
    r"(<!-- forgery-suite-best --attacks (?P<attacks>[a-z0-9,-]+) -->\n)(.*?)"
    r"(<!-- /forgery-suite-best -->)",
    re.DOTALL,
)


def doc_blocks(text: str, *, best: bool = False) -> list[tuple[str, list[str]]]:
    """The ``(recipe, attacks)`` of every table block of a page, in page order; ``best``:
    the best undetected effect's blocks too (Torch blocks)."""
    blocks = [(m["recipe"], m["attacks"].split(",")) for m in DOC_BLOCK.finditer(text)]
    if best:
        blocks += [("torch", m["attacks"].split(",")) for m in DOC_BEST.finditer(text)]
    return blocks


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def best_undetected(results: dict[str, Result], below: float) -> Result | None:
    """Of the forgers caught in fewer than ``below`` of their trials, the one whose model
    carries the largest backdoor (mean over its runs of ``backdoor success, forged``);
    ties (no backdoor firing at all) go to the largest mean probability of the backdoor's
    target, then to the largest distance from the honest model when missed. None when every forger was caught at least that often."""
    escaped = [
        r
        for r in results.values()
        if r.trials and r.caught / r.trials < below and "backdoor success, forged" in r.extra
    ]
    if not escaped:
        return None
    return max(
        escaped,
        key=lambda r: (
            _mean(r.extra["backdoor success, forged"]),
            _mean(r.extra.get("backdoor target probability, forged", [])),
            _mean(r.missed_distance),
        ),
    )


def best_text(results: dict[str, Result]) -> str:
    """The best undetected effect, as ``docs/soundness.md`` and the certificate state it:
    one line per detection level (caught in fewer than 0.95, and than 0.05, of trials)."""
    lines = []
    for below in (0.95, 0.05):
        best = best_undetected(results, below)
        if best is None:
            lines.append(f"* caught in fewer than {below:g} of trials: none of these forgers")
            continue
        low, high = wilson(best.caught, best.trials)
        success = best.extra["backdoor success, forged"]
        target = best.extra.get("backdoor target probability, forged")
        honest = best.extra.get("backdoor target probability, honest")
        probability = (
            f"; mean probability of the target {_fmt(target)} (honest: {_fmt(honest)})"
            if target and honest
            else ""
        )
        lines.append(
            f"* caught in fewer than {below:g} of trials: `{best.attack}`, backdoor success "
            f"**{_mean(success):.3f}** of triggered inputs (largest run {max(success):.3f}; "
            f"{best.runs} runs{probability}), caught in {best.caught / best.trials:.3f} "
            f"[{low:.3f}, {high:.3f}] of {best.trials} trials; when missed, its model "
            f"{_fmt(best.missed_distance)} of the honest run's travel from the honest model"
        )
    return "\n".join(lines)


def render_docs(
    text: str,
    results: dict[str, dict[str, Result]],
    steps: int,
    run_line: str,
    *,
    append: bool = False,
) -> str:
    """The page with every block's table rebuilt from ``results`` (by recipe, by attack)
    and the run line replaced (``append``: added to the run paragraph, for a run that
    measured only some blocks); a block naming an attack ``results`` lacks is left as it
    is, and nothing outside the blocks changes."""

    def block(match: re.Match[str]) -> str:
        measured = results.get(match["recipe"], {})
        if any(a not in measured for a in match["attacks"].split(",")):
            return match.group(0)
        chosen = {a: measured[a] for a in match["attacks"].split(",")}
        rendered = table(chosen, steps).split("\n", 2)[2]  # without the "T = ..." line
        return f"{match.group(1)}{rendered}\n{match.group(5)}"

    def best(match: re.Match[str]) -> str:
        measured = results.get("torch", {})
        if any(a not in measured for a in match["attacks"].split(",")):
            return match.group(0)
        chosen = {a: measured[a] for a in match["attacks"].split(",")}
        return f"{match.group(1)}{best_text(chosen)}\n{match.group(4)}"

    text = DOC_BEST.sub(best, DOC_BLOCK.sub(block, text))
    if append:
        return DOC_RUN.sub(lambda m: f"{m.group(1)}{m.group(2)}{run_line}\n{m.group(3)}", text)
    return DOC_RUN.sub(lambda m: f"{m.group(1)}{run_line}\n{m.group(3)}", text)


def update_docs(
    path: Path, *, trials: int, draws: int, steps: int, seed: int, only: list[str] | None = None
) -> None:
    """Measure every attack the page's tables name, at these settings, and rewrite them;
    with ``only``, just the blocks whose every attack is among ``only`` (the run line is
    then added to the page's run paragraph, which still describes the other blocks)."""
    text = path.read_text()
    wanted: dict[str, list[str]] = {"torch": [], "jax": []}
    for recipe, attacks in doc_blocks(text, best=True):
        if only is not None and any(a not in only for a in attacks):
            continue
        wanted[recipe] += [a for a in attacks if a not in wanted[recipe]]
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    results: dict[str, dict[str, Result]] = {}
    for recipe, run in (("torch", run_suite), ("jax", run_jax_suite)):
        if wanted[recipe]:
            results[recipe] = run(
                wanted[recipe], trials=trials, draws=draws, steps=steps, seed=seed,
                progress=progress,
            )  # fmt: skip
    import jax

    now = time.gmtime()
    when = f"{now.tm_mday} {time.strftime('%B %Y, %H:%M UTC', now)}"
    seeds = f"seed {seed}" if trials == 1 else f"seeds {seed} to {seed + trials - 1}"
    chosen = "" if only is None else f" --attacks {','.join(only)}"
    run_line = (
        f"`python bench/forgery_suite.py --update-docs --trials {trials} --steps {steps} "
        f"--draws {draws} --seed {seed}{chosen}`, run on {when}: {seeds}, "
        f"{trials} forged runs per attack, each met by {draws} platform draws; "
        f"{time.perf_counter() - started:.0f} s wall time in all (torch {torch.__version__}, "
        f"jax {jax.__version__})."
    )
    path.write_text(render_docs(text, results, steps, run_line, append=only is not None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="forged runs per attack (seeds)")
    parser.add_argument("--draws", type=int, default=400, help="platform draws per run")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument(
        "--attacks",
        default="",
        help="comma-separated (default: every one); with --update-docs, rewrite only the "
        "blocks whose every attack is named",
    )
    parser.add_argument(
        "--recipe",
        choices=("torch", "jax"),
        default="torch",
        help="the Torch LM recipe, or the JAX one (the attacks a JAX lab can mount)",
    )
    parser.add_argument("--seed", type=int, default=0, help="first run seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--quick", action="store_true", help="1 run per attack, 36 steps, 100 draws"
    )
    parser.add_argument(
        "--update-docs",
        nargs="?",
        const=str(ROOT / "docs" / "soundness.md"),
        help="measure every attack the page's tables name and rewrite them "
        "(default page: docs/soundness.md)",
    )
    arguments = parser.parse_args()
    if arguments.update_docs:
        torch.set_num_threads(arguments.threads)
        only = [a.strip() for a in arguments.attacks.split(",") if a.strip()] or None
        update_docs(
            Path(arguments.update_docs), trials=arguments.trials, draws=arguments.draws,
            steps=arguments.steps, seed=arguments.seed, only=only,
        )  # fmt: skip
        return
    if arguments.quick:
        arguments.trials, arguments.steps, arguments.draws = 1, 36, 100
    known: tuple[str, ...] = ATTACKS
    if arguments.recipe == "jax":
        from bench import _forgery_jax as forgery_jax

        known = forgery_jax.ATTACKS
    attacks = [a.strip() for a in arguments.attacks.split(",") if a.strip()] or list(known)
    for attack in attacks:
        if attack not in known:
            parser.error(f"unknown attack {attack!r}; choose from {', '.join(known)}")
    torch.set_num_threads(arguments.threads)
    started = time.perf_counter()
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    run = run_jax_suite if arguments.recipe == "jax" else run_suite
    results = run(
        attacks, trials=arguments.trials, draws=arguments.draws, steps=arguments.steps,
        seed=arguments.seed, progress=progress,
    )  # fmt: skip
    print(
        f"python bench/forgery_suite.py --recipe {arguments.recipe} --trials {arguments.trials} "
        f"--draws {arguments.draws} --steps {arguments.steps} --seed {arguments.seed} "
        f"--attacks {','.join(attacks)}"
    )
    print(table(results, arguments.steps))
    versions = f"torch {torch.__version__}"
    if arguments.recipe == "jax":
        import jax

        versions = f"jax {jax.__version__}"
    print(f"\nwall time {time.perf_counter() - started:.0f} s, {versions}")


if __name__ == "__main__":
    main()
