"""The platform's challenge draw: coverage, detection bound, reproducibility."""

from __future__ import annotations

import math
import os
import random

import pytest

from provers.challenges import draw_challenges, random_steps_needed, seed_commitment

DIGEST = "ab" * 32


def test_default_target_needs_299_steps_on_long_runs() -> None:
    assert random_steps_needed(10**9, target=0.95, forged_fraction=0.01) == math.ceil(
        math.log(0.05) / math.log(0.99)
    )
    # Short runs need fewer (without replacement) and are capped by their length.
    assert random_steps_needed(100, target=0.95, forged_fraction=0.01) == 95
    assert random_steps_needed(10, target=0.95, forged_fraction=0.01) == 10


def test_plan_always_covers_genesis_and_self_checks() -> None:
    plan = draw_challenges(steps=10_000, transcript_digest=DIGEST, self_checked=[17, 4242, 9999])
    assert plan.steps[0] == 0
    assert {17, 4242, 9999} <= set(plan.steps)
    assert len(plan.steps) >= random_steps_needed(10_000, target=0.95, forged_fraction=0.01) >= 290
    assert plan.commitment == seed_commitment(plan.seed)


def test_plan_is_reproducible_from_the_revealed_seed_and_bound_to_the_transcript() -> None:
    seed = os.urandom(32)
    first = draw_challenges(steps=5000, transcript_digest=DIGEST, seed=seed)
    assert draw_challenges(steps=5000, transcript_digest=DIGEST, seed=seed) == first
    assert draw_challenges(steps=5000, transcript_digest="cd" * 32, seed=seed).steps != first.steps
    assert draw_challenges(steps=5000, transcript_digest=DIGEST).steps != first.steps


def test_detection_rate_meets_the_target_empirically() -> None:
    # A run of 2,000 steps with 1 % forged: the plan must catch it in >= 95 % of draws.
    rng = random.Random(5)
    steps, trials, caught = 2000, 400, 0
    for _ in range(trials):
        forged = set(rng.sample(range(1, steps), 20))
        plan = draw_challenges(steps=steps, transcript_digest=DIGEST)
        caught += bool(forged & set(plan.steps))
    assert caught / trials >= 0.92  # 0.95 target, minus sampling noise of 400 trials


def test_small_runs_are_challenged_entirely() -> None:
    assert draw_challenges(steps=7, transcript_digest=DIGEST).steps == tuple(range(7))


@pytest.mark.parametrize(
    "bad", [{"steps": 0}, {"seed": b"short"}, {"target": 1.0}, {"forged_fraction": 0}]
)
def test_invalid_inputs_are_rejected(bad: dict[str, object]) -> None:
    args: dict[str, object] = {"steps": 10, "transcript_digest": DIGEST, **bad}
    with pytest.raises(ValueError):
        draw_challenges(**args)  # type: ignore[arg-type]
