"""Which slice a challenge opens, and how likely a slice is to catch a forger.

The draws (:func:`draw_challenge`: a uniform step and block after the commitment;
:func:`draw_sequences`: the opened sequences, only after the lab's projections) and the
detection probabilities of ``docs/scale.md``, "Soundness"
(:func:`detection_probability`, :func:`challenges_needed`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from zkdv.hashing import Domain, hasher
from zkdv.sliced._commitment import _hash


@dataclass(frozen=True)
class SliceChallenge:
    """``(step, block)`` and the seed of the Freivalds directions, drawn after commitment."""

    step: int
    block: int
    seed: bytes
    projections: int = 4


def _stream(*parts: bytes) -> Any:
    h = hasher(Domain.SAMPLE)
    for part in parts:
        h.update(part)
    offset = 0
    while True:
        block = h.digest(length=512, seek=offset)
        offset += len(block)
        for i in range(0, len(block), 8):
            yield int.from_bytes(block[i : i + 8], "little")


def _uniform(values: Any, n: int) -> int:
    limit = (1 << 64) - ((1 << 64) % n)  # rejection sampling: no modulo bias
    for value in values:
        if value < limit:
            return int(value % n)
    raise AssertionError("unreachable: the stream is unbounded")


def draw_challenge(
    seed: bytes, side_digest: bytes, *, index: int, steps: int, blocks: int, projections: int = 4
) -> SliceChallenge:
    """The ``index``-th sliced challenge of a run: a uniform step and a uniform block.

    Args:
        seed: the platform's secret 32-byte seed (revealed in the certificate).
        side_digest: :func:`side_file_digest` of the committed run.
    """
    if len(seed) != 32:
        raise ValueError(f"the challenge seed must be 32 bytes, got {len(seed)}")
    values = _stream(b"zkdv-sliced-v0 challenge", seed, side_digest, struct.pack("<Q", index))
    step = _uniform(values, steps)
    block = _uniform(values, blocks)
    directions = _hash(b"zkdv-sliced-v0 directions", seed, side_digest, struct.pack("<Q", index))
    return SliceChallenge(step, block, directions, projections)


def draw_sequences(
    seed: bytes,
    challenge: SliceChallenge,
    answer_digest: bytes,
    *,
    micro_batches: int,
    rows: int,
    count: int,
) -> tuple[tuple[int, int], ...]:
    """Which sequences ``(micro, row)`` to open, drawn only after the lab's projections.

    The lab learns the opened sequences only after it has sent every ``c_i``, so it
    cannot put a lie where nobody looks. The draw uses the platform's *secret* seed (the
    lab knows ``challenge.seed``, the directions' seed, and could otherwise try answers
    until the draw avoided its lie); binding it to the answer's digest lets anyone re-derive
    it once the seed is revealed in the certificate.

    Args:
        seed: the platform's secret 32-byte seed, the one :func:`draw_challenge` took.
    """
    if len(seed) != 32:
        raise ValueError(f"the challenge seed must be 32 bytes, got {len(seed)}")
    population = micro_batches * rows
    if not 1 <= count <= population:
        raise ValueError(f"cannot open {count} of {population} sequences")
    values = _stream(
        b"zkdv-sliced-v0 sequences",
        seed,
        challenge.seed,
        struct.pack("<QQ", challenge.step, challenge.block),
        answer_digest,
    )
    chosen: list[int] = []
    while len(chosen) < count:
        pick = _uniform(values, population)
        if pick not in chosen:
            chosen.append(pick)
    return tuple(sorted((pick // rows, pick % rows) for pick in chosen))


def detection_probability(
    forgery: str,
    *,
    forged_fraction: float,
    blocks: int,
    sequences: int,
    opened: int,
    per_micro_batch: int = 1,
    lied: int = 1,
) -> float:
    """Probability that one sliced challenge catches a run in which ``forged_fraction`` of
    steps carry ``forgery`` (``docs/scale.md``, "Soundness").

    ``"step"``: every block of a forged step is wrong, so any slice of it fails.
    ``"block"``: one block's update (weights nudged, gradient changed within the
    projections); caught when that block is drawn. ``"micro-batch"``: one micro-batch's
    boundary at one interior boundary, read by two blocks; caught when one of them is
    drawn and an opened sequence is in the micro-batch. ``"data"``: the tokens of
    ``per_micro_batch`` sequences substituted (trained on, not committed), everything
    downstream consistent; the input check of any block catches it when one of them is
    opened. ``"projection"``: a block's gradient changed and the difference hidden in
    ``lied`` sequences' projections; caught when the block is drawn and one of them is
    opened.
    """
    hit_micro = 1.0 - _miss(sequences, per_micro_batch, opened)
    per_step = {
        "step": 1.0,
        "block": 1.0 / blocks,
        "micro-batch": min(1.0, 2.0 / blocks) * hit_micro,
        "data": hit_micro,
        "projection": (1.0 / blocks) * (1.0 - _miss(sequences, lied, opened)),
    }
    if forgery not in per_step:
        raise ValueError(f"unknown forgery {forgery!r}; one of {', '.join(per_step)}")
    return forged_fraction * per_step[forgery]


def _miss(population: int, marked: int, drawn: int) -> float:
    """Probability that ``drawn`` of ``population`` without replacement miss ``marked``."""
    if marked <= 0:
        return 1.0
    if drawn > population - marked:
        return 0.0
    return math.comb(population - marked, drawn) / math.comb(population, drawn)


def challenges_needed(per_challenge: float, target: float = 0.95) -> int:
    """Independent challenges so that at least one catches the forger with ``target``."""
    if not 0.0 < per_challenge <= 1.0:
        raise ValueError(f"per-challenge detection {per_challenge!r} must be in (0, 1]")
    if per_challenge == 1.0:
        return 1
    return math.ceil(math.log(1.0 - target) / math.log(1.0 - per_challenge))
