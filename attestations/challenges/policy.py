"""How the platform challenges: the policy (from settings) and the replay time limit."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings

from attestations.core.db import task_time_limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChallengePolicy:
    """The detection target, the forged fraction it is computed for, and the answer TTL."""

    target: float
    forged_fraction: float
    ttl: timedelta

    @classmethod
    def from_settings(cls) -> ChallengePolicy:
        knobs: Mapping[str, Any] = settings.DVBENCH
        return cls(
            target=float(knobs["DETECTION_TARGET"]),
            forged_fraction=float(knobs["FORGED_FRACTION"]),
            ttl=timedelta(seconds=int(knobs["CHALLENGE_TTL_SECONDS"])),
        )


def replay_time_limit() -> int:
    """Seconds after which a ``replaying`` claim is stale (its worker died)."""
    return int(task_time_limit().total_seconds())
