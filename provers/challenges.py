"""Server-side challenges: which steps the platform replays, drawn after the commitment.

The trainer commits to its whole run (the transcript digest) before the platform draws
anything. The platform then takes a fresh 32-byte seed from its own CSPRNG, publishes
only ``SHA-256(seed)`` while challenges are outstanding, and reveals the seed in the
certificate. Steps derive deterministically from ``(seed, transcript digest)``, so
anyone holding the certificate can re-derive them and see that nothing was hand-picked.

Which steps:

* step 0 always: the genesis check binds the committed program and initial state to a
  real execution;
* every step the trainer self-checked (its Fiat-Shamir sample, recomputed by the
  verifier), so the platform confirms the trainer's own checks independently;
* enough uniformly random further steps that a run in which a fraction ``f`` of steps
  is forged is caught with probability at least ``target``: sampling ``k`` distinct
  steps of ``T`` misses every forged one with probability
  ``C(T - fT, k) / C(T, k) <= (1 - f)^k``, so ``k = ceil(ln(1 - target) / ln(1 - f))``
  (299 for the default 95 % and 1 %), capped by the run's length.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from zkdv.hashing import hasher

__all__ = ["ChallengePlan", "draw_challenges", "random_steps_needed", "seed_commitment"]

DEFAULT_TARGET = 0.95
DEFAULT_FORGED_FRACTION = 0.01


def random_steps_needed(steps: int, *, target: float, forged_fraction: float) -> int:
    """Random steps to sample so a forged fraction is caught with ``target`` probability.

    Uses the exact hypergeometric miss probability, which needs at most the binomial
    bound's ``ceil(ln(1 - target) / ln(1 - f))`` steps and fewer on short runs.
    """
    if not 0.0 <= target < 1.0:
        raise ValueError(f"detection target {target!r} must be in [0, 1)")
    if not 0.0 < forged_fraction <= 1.0:
        raise ValueError(f"forged fraction {forged_fraction!r} must be in (0, 1]")
    if steps <= 0 or target == 0.0:
        return 0
    forged = max(1, math.ceil(forged_fraction * steps))
    miss = 1.0
    for k in range(1, steps + 1):
        # P(miss after k draws) = prod_{i<k} (T - F - i) / (T - i)
        miss *= max(0.0, (steps - forged - (k - 1)) / (steps - (k - 1)))
        if 1.0 - miss >= target:
            return k
    return steps


def seed_commitment(seed: bytes) -> str:
    """What the platform publishes before revealing ``seed``."""
    return hashlib.sha256(seed).hexdigest()


@dataclass(frozen=True)
class ChallengePlan:
    """The platform's challenges for one transcript, reproducible from the seed."""

    seed: bytes
    transcript_digest: str
    steps: tuple[int, ...]
    genesis: int
    self_checked: tuple[int, ...]
    random: tuple[int, ...]
    target: float
    forged_fraction: float

    @property
    def commitment(self) -> str:
        return seed_commitment(self.seed)

    def to_dict(self) -> dict[str, object]:
        return {
            "seed": self.seed.hex(),
            "seed_commitment": self.commitment,
            "transcript_digest": self.transcript_digest,
            "steps": list(self.steps),
            "genesis": self.genesis,
            "self_checked": list(self.self_checked),
            "random": list(self.random),
            "target": self.target,
            "forged_fraction": self.forged_fraction,
        }


def _stream(seed: bytes, digest: bytes) -> Iterable[int]:
    """Unbounded uniform 64-bit integers from BLAKE3's XOF keyed by the seed."""
    h = hasher("sample")
    h.update(b"dvbench-challenges-v1")
    h.update(seed)
    h.update(digest)
    offset = 0
    while True:
        block = h.digest(length=8 * 64, seek=offset)
        offset += len(block)
        for i in range(0, len(block), 8):
            yield int.from_bytes(block[i : i + 8], "little")


def draw_challenges(
    *,
    steps: int,
    transcript_digest: str,
    self_checked: Iterable[int] = (),
    seed: bytes | None = None,
    target: float = DEFAULT_TARGET,
    forged_fraction: float = DEFAULT_FORGED_FRACTION,
) -> ChallengePlan:
    """Draw the challenged steps of a committed transcript of ``steps`` steps.

    Args:
        steps: number of steps in the transcript.
        transcript_digest: hex digest of the stored transcript (binds the draw to it).
        self_checked: steps the trainer's own sampling checked.
        seed: the platform's secret seed; a fresh CSPRNG seed when None. Pass the
            revealed seed to re-derive a certificate's challenges.
        target: probability of catching a run with ``forged_fraction`` forged steps.
    """
    if steps < 1:
        raise ValueError("a transcript with no steps cannot be challenged")
    seed = secrets.token_bytes(32) if seed is None else seed
    if len(seed) != 32:
        raise ValueError("the challenge seed must be 32 bytes")
    digest = bytes.fromhex(transcript_digest)
    own = tuple(sorted({s for s in self_checked if 0 <= s < steps}))
    fixed = {0, *own}
    wanted = random_steps_needed(steps, target=target, forged_fraction=forged_fraction)
    # Random steps are drawn uniformly from all steps; those already fixed still count
    # towards the detection bound, since they are replayed all the same.
    chosen: list[int] = []
    seen: set[int] = set()
    limit = (1 << 64) - ((1 << 64) % steps)  # rejection sampling: no modulo bias
    for value in _stream(seed, digest):
        if len(seen) >= min(wanted, steps):
            break
        if value >= limit:
            continue
        step = value % steps
        if step not in seen:
            seen.add(step)
            chosen.append(step)
    random_only = tuple(sorted(set(chosen) - fixed))
    return ChallengePlan(
        seed=seed,
        transcript_digest=transcript_digest,
        steps=tuple(sorted(fixed | set(chosen))),
        genesis=0,
        self_checked=own,
        random=random_only,
        target=target,
        forged_fraction=forged_fraction,
    )
