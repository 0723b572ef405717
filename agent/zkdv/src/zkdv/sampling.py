"""Fiat-Shamir sampling: which steps are checked, and which coordinates.

The decision for step ``t`` and its challenged parameter and optimizer-state indices
derive from the hash of step ``t``'s record, so they are fixed once the record is
written and a verifier recomputes every one: a skipped or altered check is detected.

Self-checks are the trainer's early warning. Because the trainer writes the record it
could grind a free field to steer these decisions; soundness against a dishonest
trainer comes from the platform's own challenges, drawn after the transcript is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from zkdv.config import SamplingPolicy
from zkdv.hashing import Domain, hasher

__all__ = ["Challenge", "Sampler", "decide"]

_TWO_64 = 1 << 64


@dataclass(frozen=True)
class Challenge:
    """A sampled check: the step and one parameter and one optimizer-state coordinate."""

    step: int
    param_index: int
    state_index: int


def _draw(material: bytes, offset: int, modulus: int) -> int:
    # 128 bits reduced modulo at most 2**64 leaves a bias below 2**-64.
    return int.from_bytes(material[offset : offset + 16], "little") % modulus if modulus else 0


class Sampler:
    """The decisions of one run, with the policy's threshold and hasher prepared once.

    The verifier calls :meth:`decide` for every step record, so the per-call work is a
    single keyed BLAKE3 hash and an integer comparison.
    """

    def __init__(self, policy: SamplingPolicy, *, param_count: int, state_count: int) -> None:
        self._every = policy.check_every
        self._threshold = int(policy.probability * _TWO_64)
        self._param_count = param_count
        self._state_count = state_count
        self._prototype = hasher(Domain.SAMPLE)

    def decide(self, step: int, record_hash: bytes) -> Challenge | None:
        h = self._prototype.copy()
        h.update(record_hash)
        h.update(step.to_bytes(8, "little"))
        material = h.digest(length=40)
        if self._every is not None:
            sampled = step % self._every == 0
        else:
            sampled = int.from_bytes(material[:8], "little") < self._threshold
        if not sampled:
            return None
        return Challenge(
            step,
            _draw(material, 8, self._param_count),
            _draw(material, 24, self._state_count),
        )


def decide(
    policy: SamplingPolicy,
    step: int,
    record_hash: bytes,
    *,
    param_count: int,
    state_count: int,
) -> Challenge | None:
    """The check decision for one step record, recomputable by any verifier.

    Indices are uint64 values covering the full committed coordinate range of the
    parameters and of the optimizer state (0 when a state is empty).
    """
    return Sampler(policy, param_count=param_count, state_count=state_count).decide(
        step, record_hash
    )
