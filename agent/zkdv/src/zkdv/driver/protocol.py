"""The two contracts between the shared driver and a frontend.

A frontend (``zkdv.jax``, ``zkdv.torch``) is a :class:`~zkdv.driver.Driver` subclass
plus the objects it hands to the driver's pipeline. The contracts go both ways:

* :class:`Submission` is what the driver needs from a frontend:
  one dispatched training step, read by the pipeline's commit and check stages;
* :class:`Runtime` is what a frontend may call on the driver: admission, the mutation
  barrier, submission, the attested program, the multi-process agreement and the
  pipeline's poison state. A frontend reaches it as ``self.runtime``
  (:attr:`~zkdv.driver.Driver.runtime`), never through the driver's private members.

The values that cross between them are here too: :class:`PendingUpdate` (the driver's
handle on a submitted step, what :meth:`Runtime.submit` returns), :class:`ReplayOutcome`
(what a sampled replay recomputed) and ``Leaves``.

Everything else a frontend needs (its program, its commitments on the device, its
snapshots) it keeps itself.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from zkdv.config import GradientBounds
from zkdv.core import ProgramInfo, State, StepResult, ZKDVCore
from zkdv.driver.flowcontrol import Admission
from zkdv.overlap import Policy
from zkdv.probes import ProbeSet
from zkdv.sampling import Challenge

__all__ = ["Leaves", "PendingUpdate", "ReplayOutcome", "Runtime", "State", "Submission"]

Leaves = Sequence[tuple[str, np.ndarray]]


@dataclass(frozen=True)
class ReplayOutcome:
    """What a sampled replay recomputed for one challenge.

    ``committed_delta``, when set, replaces the update value ``capture`` returned: a
    frontend whose optimizer updates parameters in place (eager Torch) captures the
    committed post-update value and forms the committed update against the replayed
    pre-update value, instead of copying every parameter before every step.

    ``gradient_within``, when set, says whether the checked step's recomputed gradient
    lies within the run's bounds of the committed one: a frontend that reads the
    committed gradient back (eager Torch) judges the whole gradient, as the platform's
    replay does, and not only the two sampled coordinates, which a forged gradient can
    leave within tolerance (a scaled one, through Adam's normalisation).
    """

    replayed_delta: float
    replayed_state: float
    replay_from: int
    replayed_steps: int
    committed_delta: float | None = None
    gradient_within: bool | None = None


class Submission(Protocol):
    """What the driver needs from a frontend: one dispatched training invocation.

    A frontend's step class subclasses it (inheriting the optional hooks) and hands
    instances to :meth:`Runtime.submit`.

    Methods run on the pipeline's threads in this order: ``computed``,
    ``initial_state`` (first submission only), ``batch``, ``post_state``, ``probes``, then ``capture`` for a
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
    #: replay snapshot step (``Runtime.snapshot_due``); the driver writes them to
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

    def computed(self) -> tuple[State, Leaves | None] | None:
        """The step's computed values (:mod:`zkdv.gradients`), or None when the run does
        not commit them: what to commit (host leaves, or their commitment when hashed on
        the device) and the host leaves to keep as ``files/grad-<step>.bin`` (None: not
        kept). The layout is the same at every step; the first fixes ``schema.grad``."""
        return None

    def probes(self, probes: ProbeSet) -> tuple[list[np.ndarray], ...] | None:
        """``(pre, post, delta)`` probe arrays per parameter leaf, and ``grad`` (the
        gradient's probes) when the step commits computed values; or None."""
        return None

    @abc.abstractmethod
    def capture(self, challenge: Challenge) -> tuple[float, float]:
        """Committed (delta, post-optimizer-state) values at the challenged indices."""

    def release_views(self) -> None:
        """Drop host views of live state (they may alias buffers about to be donated)."""

    def snapshot_written(self) -> None:
        """The snapshot's file is written (or failed): its host copy may be reused.

        Called on the snapshot stage, possibly after :meth:`retire`.
        """

    @abc.abstractmethod
    def replay(self, challenge: Challenge) -> ReplayOutcome:
        """Recompute the challenged coordinates from the latest snapshot."""

    def retire(self) -> None:
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


class Runtime(Protocol):
    """What a frontend may call on its driver (``Driver.runtime``).

    Lifecycle guards raise :class:`~zkdv.errors.ZKDVError` (closed, not started) or
    :class:`~zkdv.errors.ZKDVPoisonedError` (an asynchronous failure), with the
    driver's own messages, so every frontend reports them alike.
    """

    # -- facts about the run -------------------------------------------------------------
    @property
    def core(self) -> ZKDVCore | None:
        """The transcript, on the process that records it once started; else None."""

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has begun."""

    @property
    def keep_files(self) -> bool:
        """Whether snapshot and batch files are written for the platform's replay."""

    @property
    def keep_gradient_files(self) -> bool:
        """Whether each step's computed values are written too (``keep_files`` and
        ``ZKDVConfig.gradient_files``): where not, nothing reads them back."""

    @property
    def max_in_flight(self) -> int:
        """The most unresolved transactions the pipeline holds."""

    @property
    def rank(self) -> int:
        """This process's rank (0 in a single-process run)."""

    @property
    def world_size(self) -> int:
        """The number of processes in the run (1 in a single-process run)."""

    @property
    def multi_process(self) -> bool:
        """Whether ranks agree on each step over :class:`~zkdv.driver.control.HostControl`."""

    # -- lifecycle guards ----------------------------------------------------------------
    def check_started(self) -> None:
        """Raise unless ``start()`` was called and ``close()`` was not."""

    def require_running(self) -> ZKDVCore:
        """The transcript of a started, open, unpoisoned driver (rank 0)."""

    def require_step(self) -> None:
        """Before a step on any rank: raise if it may not run; rank 0 tells followers why."""

    # -- the step path -------------------------------------------------------------------
    def admit(self, policy: Policy) -> Admission:
        """Block until a transaction of ``policy`` may start (single process)."""

    def agree(self, policy: Any, *, barrier: bool = False) -> Admission | None:
        """Multi-process admission: every rank learns whether rank 0 goes on.

        Returns rank 0's admission; None on a follower (it runs the step and records
        nothing). With ``barrier`` rank 0 also waits for the previous commitment to
        release the state this step donates.
        """

    def barrier(self, *, raise_poison: bool = True) -> bool:
        """Wait until the previous step's commitment stopped reading live state.

        With ``raise_poison`` a poisoned pipeline raises; without, the wait returns
        False as soon as the pipeline is poisoned (a multi-process rank reports at its
        next step instead), and True once released.
        """

    def snapshot_due(self, index: int) -> bool:
        """Whether step ``index`` takes a replay snapshot of its pre-update state."""

    def submit(self, admission: Admission, submission: Submission) -> PendingUpdate:
        """Queue one dispatched step's commitment (and, if sampled, its check)."""

    def set_program(
        self,
        kind: str,
        material: bytes | bytearray | memoryview,
        *,
        env: dict[str, Any],
        shardings: dict[str, Any] | None = None,
        bounds: GradientBounds | None = None,
    ) -> ProgramInfo:
        """Commit the attested program's bytes and the environment it runs in.

        Before the first step only; ``shardings`` describes multi-device leaf layouts
        for the root record's schema; ``bounds`` are the gradient bounds of a run that
        commits its computed values, when the configuration sets none
        (:meth:`~zkdv.config.GradientBounds.default` for the program's precision).
        """

    # -- failures ------------------------------------------------------------------------
    @property
    def poisoned(self) -> BaseException | None:
        """The first asynchronous failure, once the pipeline is poisoned."""

    def check(self) -> None:
        """Raise :class:`~zkdv.errors.ZKDVPoisonedError` once the pipeline is poisoned."""

    def poison(self, error: BaseException) -> None:
        """Poison the pipeline: every later step and ``close()`` raise ``error``."""

    def share_failure(self, message: str) -> None:
        """Multi-process: every later step on this rank raises ``message`` as poisoned."""

    def announce_failure(self, error: BaseException) -> None:
        """Rank 0 failed before its step: tell the followers waiting for that step."""

    def exchange(self, key: str, value: Any = None) -> Any:
        """One HostControl round: rank 0 publishes ``value`` under ``key``, followers get it."""
