"""Fiat-Shamir sampling: rate, index range, and recomputability."""

from __future__ import annotations

import math
import os

from zkdv.config import SamplingPolicy
from zkdv.sampling import decide

STEPS = 100_000


def test_rate_is_within_binomial_bounds_over_100k_steps() -> None:
    policy = SamplingPolicy(update_check_probability=0.01)
    sampled = sum(
        decide(policy, step, os.urandom(32), param_count=10, state_count=10) is not None
        for step in range(STEPS)
    )
    mean = STEPS * 0.01
    sd = math.sqrt(STEPS * 0.01 * 0.99)
    # Six standard deviations: a false alarm once in ~500 million runs.
    assert abs(sampled - mean) < 6 * sd, sampled


def test_indices_cover_the_full_uint64_range() -> None:
    policy = SamplingPolicy.DEBUGCheckEvery(1)
    huge = 2**64 - 1
    drawn = [
        decide(policy, s, os.urandom(32), param_count=huge, state_count=huge) for s in range(2000)
    ]
    params = [c.param_index for c in drawn if c]
    assert max(params) > 2**63  # the top bit is reachable
    assert all(0 <= p < huge for p in params)


def test_decisions_are_a_function_of_the_record_hash() -> None:
    policy = SamplingPolicy(update_check_probability=0.5)
    digest = bytes(range(32))
    first = [decide(policy, s, digest, param_count=1000, state_count=77) for s in range(200)]
    again = [decide(policy, s, digest, param_count=1000, state_count=77) for s in range(200)]
    assert first == again
    other = [decide(policy, s, bytes(32), param_count=1000, state_count=77) for s in range(200)]
    assert first != other


def test_debug_check_every_n() -> None:
    policy = SamplingPolicy.DEBUGCheckEvery(3)
    hits = [s for s in range(10) if decide(policy, s, os.urandom(32), param_count=5, state_count=0)]
    assert hits == [0, 3, 6, 9]
    # An empty optimizer state still yields a challenge, at coordinate 0.
    assert decide(policy, 0, bytes(32), param_count=5, state_count=0).state_index == 0
