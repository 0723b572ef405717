"""Bounded completion queue for asynchronous pipeline transactions.

The training thread admits one transaction per step through :meth:`PipelineQueue.acquire`
and hands the slow work (hashing, commitment, sampled checks, replay snapshots) to
per-stage worker threads. Admission is where memory is bounded: every admitted,
unretired transaction pins one generation of device buffers, so the queue limits how
many exist under the overlap policy of every transaction involved
(:mod:`zkdv.overlap`):

* ``ALWAYS`` and ``UNCHECKED`` allow up to ``capacity`` live transactions;
  ``NEVER`` allows one, so a ``NEVER`` transaction is admitted only when nothing else
  is live, and nothing is admitted while a ``NEVER`` transaction is live.
* A sampled check *fences* admission (:meth:`PipelineQueue.fence`). Under
  ``UNCHECKED`` the fence holds until the check completes, so only the successor
  admitted before the sampling decision was known stays live beside it. Under
  ``ALWAYS`` the fence lifts as soon as the check has acquired its inputs, letting
  training and verification overlap. Under ``NEVER`` it holds until the check
  completes, and a ``NEVER`` admission also waits for every outstanding check.

The policies bound live generations, not allocator bytes. :meth:`PipelineQueue.live`
and :attr:`PipelineQueue.max_live` expose the count so tests can assert the bound.

Any exception raised by work on a stage poisons the queue: queued work is skipped, and
:meth:`PipelineQueue.check`, :meth:`PipelineQueue.acquire` and
:meth:`PipelineQueue.join` raise :class:`~zkdv.errors.ZKDVPoisonedError` chained to
the first failure.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from zkdv import workers
from zkdv.errors import POISONED, ZKDVError, ZKDVPoisonedError
from zkdv.overlap import Policy

__all__ = ["STAGES", "Admission", "Annotation", "PipelineQueue", "unannotated"]

P = ParamSpec("P")
T = TypeVar("T")

Annotation = Callable[[str], AbstractContextManager[Any]]
"""A profiler-range factory: ``annotation("zkdv.commit")`` returns a context manager.

Frontends pass ``torch.profiler.record_function`` or ``jax.named_scope``-style ranges;
the queue only enters and exits them around its own waits and stage work.
"""

STAGES = ("start", "prepare", "commit", "check", "snapshot")

QUEUE_CLOSED = "ZKDV pipeline queue is closed"

# Retirement and fence events belong to other components, and threading.Event cannot
# notify a second waiter, so a blocked acquire wakes on its most likely event and also
# at this interval to notice any other event, a poisoning or a close.
_POLL_SECONDS = 0.05


def unannotated(name: str) -> AbstractContextManager[None]:
    """The default annotation: no profiler range."""
    return contextlib.nullcontext()


def _limit(policy: Policy, capacity: int) -> int:
    return 1 if policy is Policy.NEVER else capacity


@dataclass(frozen=True)
class _Fence:
    done: threading.Event
    policy: Policy
    acquired: threading.Event | None

    def blocks(self, policy: Policy) -> threading.Event | None:
        """Return the event ``policy``'s admission must wait for, or None."""
        if self.done.is_set():
            return None
        if (
            self.policy is Policy.ALWAYS
            and policy is not Policy.NEVER
            and self.acquired is not None
        ):
            return None if self.acquired.is_set() else self.acquired
        return self.done


class Admission:
    """One admitted transaction's reserved slot, returned by :meth:`PipelineQueue.acquire`.

    The slot counts as live from admission. Call :meth:`register` with the event that
    marks the transaction's retirement, or :meth:`cancel` if the transaction never
    starts. Used as a context manager, it cancels the slot when the block raises before
    registration, so a failed step cannot leak a slot and stall the next one.
    """

    def __init__(self, queue: PipelineQueue, policy: Policy) -> None:
        self._queue = queue
        self.policy = policy
        self._settled = False
        self._lock = threading.Lock()

    def _settle(self) -> bool:
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def register(self, retirement: threading.Event) -> None:
        """Keep the slot until ``retirement`` is set.

        Raises:
            RuntimeError: the admission was already registered or cancelled.
        """
        if not self._settle():
            raise RuntimeError("ZKDV admission was already registered or cancelled")
        self._queue.register(retirement, self.policy)

    def cancel(self) -> None:
        """Release the slot without registering; does nothing once settled."""
        if self._settle():
            self._queue.release(self.policy)

    def __enter__(self) -> Admission:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None:
            self.cancel()


class PipelineQueue:
    """Bound unresolved transactions and complete their native submissions.

    Stages run on their own worker threads. ``start``, ``commit``, ``check`` and
    ``snapshot`` have one worker each, so their work runs strictly in submission
    (FIFO) order: commitments extend a hash chain and must be appended in step order.
    ``prepare`` has ``capacity`` workers: preparations of different generations are
    independent, start in FIFO order and may run concurrently.

    Args:
        capacity: the most live transactions any policy allows (``max_in_flight``).
        annotation: profiler-range factory; see :data:`Annotation`.

    Raises:
        ValueError: ``capacity`` is below one.
    """

    def __init__(self, capacity: int, annotation: Annotation = unannotated) -> None:
        if isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"ZKDV max_in_flight must be positive, got {capacity!r}")
        # Decided here, on the training thread: a wrong ZKDV_WORKER_PRIORITY raises now,
        # not in a worker's initializer (which would only break the pool).
        workers.idle()
        self._capacity = int(capacity)
        self._annotation = annotation
        self._lock = threading.Lock()
        self._active: list[tuple[threading.Event, Policy]] = []
        self._reserved: list[Policy] = []
        self._fences: list[_Fence] = []
        self._max_live = 0
        self._waiting = 0
        self._poison: BaseException | None = None
        self._closed = False
        self._pending: set[Future[Any]] = set()
        self._executors = {
            stage: ThreadPoolExecutor(
                max_workers=self._capacity if stage == "prepare" else 1,
                thread_name_prefix=f"zkdv-{stage}",
                initializer=workers.demote,
            )
            for stage in STAGES
        }

    @property
    def capacity(self) -> int:
        """The ceiling on live transactions (``max_in_flight``)."""
        return self._capacity

    @property
    def max_live(self) -> int:
        """The most transactions that were ever live at once (a high-water mark)."""
        with self._lock:
            return self._max_live

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def poisoned(self) -> BaseException | None:
        """The first asynchronous failure, or None."""
        return self._poison

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        """Open a profiler range through the frontend's annotation factory."""
        return self._annotation(name)

    # -- observability -------------------------------------------------------------

    def _discard_retired(self) -> None:
        self._active = [entry for entry in self._active if not entry[0].is_set()]
        self._fences = [fence for fence in self._fences if not fence.done.is_set()]

    def live(self) -> int:
        """Transactions admitted and not yet retired, registered or not."""
        with self._lock:
            self._discard_retired()
            return len(self._active) + len(self._reserved)

    def fences(self) -> int:
        """Sampled-check fences whose check has not completed."""
        with self._lock:
            self._discard_retired()
            return len(self._fences)

    def waiting(self) -> int:
        """Threads currently blocked in :meth:`acquire`."""
        with self._lock:
            return self._waiting

    # -- admission -----------------------------------------------------------------

    def _admit(self, policy: Policy) -> threading.Event | bool | None:
        """Reserve a slot (True) or name what to wait for (an event, or None to poll)."""
        self._discard_retired()
        for fence in self._fences:
            blocker = fence.blocks(policy)
            if blocker is not None:
                return blocker
        policies = [policy, *self._reserved, *(entry[1] for entry in self._active)]
        live = len(self._reserved) + len(self._active)
        if live < min(_limit(item, self._capacity) for item in policies):
            self._reserved.append(policy)
            self._max_live = max(self._max_live, live + 1)
            return True
        # Retirements are FIFO in practice (commitments are), so the oldest is next.
        return self._active[0][0] if self._active else None

    def acquire(
        self, policy: Policy = Policy.UNCHECKED, *, timeout: float | None = None
    ) -> Admission:
        """Admit one transaction under every active transaction's policy.

        Blocks until the transaction fits: no pending fence holds admission for
        ``policy`` and the live count is below the limit of ``policy`` and of every
        live transaction's policy.

        Args:
            policy: the new transaction's overlap policy.
            timeout: seconds to wait at most; None waits indefinitely.

        Returns:
            The reserved slot; register its retirement event or cancel it.

        Raises:
            ZKDVPoisonedError: the queue was poisoned before or while waiting.
            ZKDVError: the queue is closed.
            TimeoutError: ``timeout`` elapsed first.
        """
        policy = Policy(policy)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.check()
        waiting = False
        # One profiler range for the whole wait, not one per poll.
        with contextlib.ExitStack() as range_:
            try:
                while True:
                    with self._lock:
                        if self._closed:
                            raise ZKDVError(QUEUE_CLOSED)
                        decision = self._admit(policy)
                        if decision is True:
                            return Admission(self, policy)
                        first_wait = not waiting
                        if first_wait:
                            waiting = True
                            self._waiting += 1
                    if first_wait:
                        range_.enter_context(self.annotate("zkdv.flow_control.wait"))
                        range_.enter_context(workers.waiting())
                    wait = _POLL_SECONDS
                    if deadline is not None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError(
                                f"ZKDV admission of a {policy.name} transaction timed out"
                            )
                        wait = min(wait, remaining)
                    if isinstance(decision, threading.Event):
                        decision.wait(wait)
                    else:
                        time.sleep(wait)
                    self.check()
            finally:
                if waiting:
                    with self._lock:
                        self._waiting -= 1

    def register(self, retirement: threading.Event, policy: Policy = Policy.UNCHECKED) -> None:
        """Keep one admitted transaction live until ``retirement`` is set.

        Consumes a slot reserved by :meth:`acquire` for ``policy`` when there is one.
        """
        policy = Policy(policy)
        with self._lock:
            with contextlib.suppress(ValueError):
                self._reserved.remove(policy)
            self._active.append((retirement, policy))
            self._discard_retired()
            live = len(self._active) + len(self._reserved)
            self._max_live = max(self._max_live, live)

    def release(self, policy: Policy = Policy.UNCHECKED) -> None:
        """Give back a slot reserved for ``policy`` that will never be registered."""
        with self._lock, contextlib.suppress(ValueError):
            self._reserved.remove(Policy(policy))

    def fence(
        self,
        done: threading.Event,
        policy: Policy = Policy.UNCHECKED,
        *,
        acquired: threading.Event | None = None,
    ) -> None:
        """Hold admission while a sampled check of a ``policy`` transaction runs.

        Register the fence *before* setting the checked transaction's retirement event,
        so no admission can slip between the two.

        Args:
            done: set when the check has completed (passed or failed).
            policy: the checked transaction's overlap policy.
            acquired: set when the check holds its inputs. Under ``ALWAYS`` the fence
                lifts then for non-``NEVER`` admissions; without it, ``ALWAYS`` is
                as conservative as ``UNCHECKED``.
        """
        with self._lock:
            self._fences.append(_Fence(done, Policy(policy), acquired))

    # -- stages --------------------------------------------------------------------

    def _run(self, stage: str, task: Callable[[], T]) -> T:
        cause = self._poison
        if cause is not None:
            # A later commitment must not extend a chain whose predecessor failed.
            raise ZKDVPoisonedError(POISONED.format(cause=cause)) from cause
        with self.annotate(f"zkdv.{stage}"):
            try:
                return task()
            except BaseException as error:
                self.poison(error)
                raise

    def _submit(
        self, stage: str, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        with self._lock:
            if self._closed:
                raise ZKDVError(QUEUE_CLOSED)
            task = functools.partial(function, *args, **kwargs)
            future = self._executors[stage].submit(self._run, stage, task)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def submit_start(
        self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``function`` on the start stage (one worker, FIFO)."""
        return self._submit("start", function, *args, **kwargs)

    def submit_prepare(
        self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``function`` on the prepare stage (``capacity`` workers, FIFO start)."""
        return self._submit("prepare", function, *args, **kwargs)

    def submit_commit(
        self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``function`` on the commit stage (one worker, FIFO)."""
        return self._submit("commit", function, *args, **kwargs)

    def submit_check(
        self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``function`` on the check stage (one worker, FIFO)."""
        return self._submit("check", function, *args, **kwargs)

    def submit_snapshot(
        self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Run ``function`` on the snapshot stage (one worker, FIFO)."""
        return self._submit("snapshot", function, *args, **kwargs)

    # -- failure and lifecycle -----------------------------------------------------

    def poison(self, error: BaseException) -> None:
        """Record an asynchronous failure; the first one is kept as the cause."""
        with self._lock:
            if self._poison is None:
                self._poison = error

    def check(self) -> None:
        """Raise if an asynchronous failure has been recorded.

        Raises:
            ZKDVPoisonedError: chained (``__cause__``) to the first failure.
        """
        cause = self._poison
        if cause is not None:
            raise ZKDVPoisonedError(POISONED.format(cause=cause)) from cause

    def join(self, *, raise_poison: bool = True, timeout: float | None = None) -> None:
        """Wait for every submitted future, including work submitted while waiting.

        Must not be called from a stage worker, which would wait for itself.

        Args:
            raise_poison: raise after waiting if the queue is poisoned.
            timeout: seconds to wait at most; None waits indefinitely.

        Raises:
            ZKDVPoisonedError: ``raise_poison`` and an asynchronous failure occurred.
            TimeoutError: ``timeout`` elapsed with work still pending.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                break
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with workers.waiting():
                _, not_done = futures.wait(pending, timeout=remaining)
            if not_done and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ZKDV pipeline still has {len(not_done)} pending stages")
            # A stage's done-callbacks may run just after wait() returns; drop finished
            # futures here so the loop cannot spin on them.
            with self._lock:
                self._pending.difference_update(future for future in pending if future.done())
        if raise_poison:
            self.check()

    def close(self) -> None:
        """Release executors after the owning driver has joined the pipeline.

        Work already submitted still runs to completion; new submissions and
        admissions raise :class:`~zkdv.errors.ZKDVError`. Calling it again does
        nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with workers.waiting():
            for executor in self._executors.values():
                executor.shutdown(wait=True, cancel_futures=False)
