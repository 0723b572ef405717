"""Shared state machine for one pending backend update.

A frontend describes each dispatched training invocation as a
:class:`~zkdv.driver.protocol.Submission`; the driver tracks it as a
:class:`PendingUpdate` while the pipeline commits it and, when sampled, replays it. See
:mod:`zkdv.driver.base` for the stages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zkdv.core import State, StepResult
from zkdv.sampling import Challenge

if TYPE_CHECKING:
    from zkdv.driver.protocol import Submission

__all__ = ["Leaves", "PendingUpdate", "ReplayOutcome", "State"]

Leaves = Sequence[tuple[str, np.ndarray]]


@dataclass(frozen=True)
class ReplayOutcome:
    """What a sampled replay recomputed for one challenge.

    ``committed_delta``, when set, replaces the update value ``capture`` returned: a
    frontend whose optimizer updates parameters in place (eager Torch) captures the
    committed post-update value and forms the committed update against the replayed
    pre-update value, instead of copying every parameter before every step.
    """

    replayed_delta: float
    replayed_state: float
    replay_from: int
    replayed_steps: int
    committed_delta: float | None = None


class PendingUpdate:
    """The driver's handle on one submitted step: its events and commitment result.

    ``released`` is the mutation barrier (set once the commit stage stops reading live
    state); ``retired`` frees the step's admission slot.
    """

    def __init__(self, index: int, submission: Submission) -> None:
        self.index = index
        self.submission = submission
        self.released = threading.Event()
        self.retired = threading.Event()
        self.result: StepResult | None = None
        self.challenge: Challenge | None = None
