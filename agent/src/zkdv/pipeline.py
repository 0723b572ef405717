"""Shared state machine for one pending backend update.

A frontend describes each dispatched training invocation as a :class:`Submission`;
the driver tracks it as a :class:`PendingUpdate` while the pipeline commits it and,
when sampled, replays it. See :mod:`zkdv.driver` for the stages.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zkdv.core import State, StepResult
from zkdv.overlap import Policy
from zkdv.probes import ProbeSet
from zkdv.sampling import Challenge

__all__ = ["Leaves", "PendingUpdate", "ReplayOutcome", "State", "Submission"]

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


class Submission(abc.ABC):
    """One dispatched training invocation, as the driver's pipeline sees it.

    Methods run on the pipeline's threads in this order: ``initial_state`` (first
    submission only), ``batch``, ``post_state``, ``probes``, then ``capture`` for a
    sampled step, then ``release_views``; later ``replay`` (sampled steps only, on the
    check thread) and ``retire``.
    """

    policy: Policy = Policy.UNCHECKED
    tokens: int | None = None
    flops: float | None = None
    started: float = 0.0
    #: The step record's ``hp``: what a scheduler set for this step (Torch), or None.
    hyperparameters: list[dict[str, Any]] | None = None
    #: Host copies of the pre-update (params, opt_state, buffers) when this step is a
    #: replay snapshot step (``Driver._snapshot_due``); the driver writes them to
    #: ``files/`` for the platform and records the snapshot in the transcript.
    snapshot: tuple[Leaves, Leaves, Leaves] | None = None

    def initial_state(self) -> tuple[State, State, State]:
        """The pre-update (params, opt_state, buffers) of the first step: host views, or
        their commitments when the frontend hashed them on the device."""
        raise NotImplementedError

    @abc.abstractmethod
    def batch(self) -> np.ndarray:
        """The committed batch as a 2-D uint32 host array."""

    @abc.abstractmethod
    def post_state(self) -> tuple[State, State, State]:
        """The post-update (params, opt_state, buffers): host views, or their commitments
        when the frontend hashed them on the device; may block."""

    def probes(
        self, probes: ProbeSet
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] | None:
        """``(pre, post, delta)`` probe arrays per parameter leaf, or None."""
        return None

    @abc.abstractmethod
    def capture(self, challenge: Challenge) -> tuple[float, float]:
        """Committed (delta, post-optimizer-state) values at the challenged indices."""

    def release_views(self) -> None:  # noqa: B027 - optional hook
        """Drop host views of live state (they may alias buffers about to be donated)."""

    def snapshot_written(self) -> None:  # noqa: B027 - optional hook
        """The snapshot's file is written (or failed): its host copy may be reused.

        Called on the snapshot stage, possibly after :meth:`retire`.
        """

    @abc.abstractmethod
    def replay(self, challenge: Challenge) -> ReplayOutcome:
        """Recompute the challenged coordinates from the latest snapshot."""

    def retire(self) -> None:  # noqa: B027 - optional hook
        """Drop every reference the submission still holds."""


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
