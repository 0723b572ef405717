"""PipelineQueue: admission bounded by overlap policies, fences, FIFO stages, poison."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from zkdv.driver.flowcontrol import Admission, PipelineQueue
from zkdv.errors import ZKDVError, ZKDVPoisonedError
from zkdv.overlap import ALWAYS, NEVER, UNCHECKED, Policy

TIMEOUT = 5.0


def wait_until(predicate: Callable[[], bool]) -> None:
    # Polls observable queue state; every assertion that follows uses events.
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


class Acquirer:
    """Runs queue.acquire on its own thread, as the training loop would block."""

    def __init__(self, queue: PipelineQueue, policy: Policy = UNCHECKED) -> None:
        self.admitted = threading.Event()
        self.admission: Admission | None = None
        self.error: BaseException | None = None
        self._queue = queue
        self._thread = threading.Thread(target=self._run, args=(policy,), daemon=True)
        waiting = queue.waiting()
        self._thread.start()
        # Either admitted at once or visibly blocked: no sleeps needed to know which.
        wait_until(lambda: self.admitted.is_set() or queue.waiting() > waiting)

    def _run(self, policy: Policy) -> None:
        try:
            self.admission = self._queue.acquire(policy)
        except (ZKDVError, TimeoutError) as error:  # what acquire raises by contract
            self.error = error
        self.admitted.set()

    def join(self) -> Admission:
        assert self.admitted.wait(TIMEOUT)
        self._thread.join(TIMEOUT)
        if self.error is not None:
            raise self.error
        assert self.admission is not None
        return self.admission


@pytest.fixture
def queue() -> Iterator[PipelineQueue]:
    queue = PipelineQueue(2)
    yield queue
    queue.close()


def admit(queue: PipelineQueue, policy: Policy = UNCHECKED) -> threading.Event:
    retirement = threading.Event()
    queue.acquire(policy, timeout=TIMEOUT).register(retirement)
    return retirement


@pytest.mark.parametrize("capacity", [0, -1, True])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="max_in_flight must be positive"):
        PipelineQueue(capacity)


def test_unchecked_transactions_pipeline_up_to_capacity(queue: PipelineQueue) -> None:
    assert queue.capacity == 2
    first, second = admit(queue), admit(queue)
    assert queue.live() == 2
    third = Acquirer(queue)
    assert not third.admitted.is_set()
    first.set()
    third.join().register(threading.Event())
    assert queue.live() == 2
    assert queue.max_live == 2
    second.set()
    assert queue.live() == 1


def test_always_transactions_share_the_same_ceiling(queue: PipelineQueue) -> None:
    first, _ = admit(queue, ALWAYS), admit(queue, ALWAYS)
    blocked = Acquirer(queue, ALWAYS)
    assert not blocked.admitted.is_set()
    first.set()
    blocked.join().cancel()
    assert queue.max_live == 2


def test_never_admits_nothing_beside_it() -> None:
    queue = PipelineQueue(4)
    try:
        for policy in (ALWAYS, UNCHECKED, NEVER):
            retirement = admit(queue, NEVER)
            follower = Acquirer(queue, policy)
            assert not follower.admitted.is_set()
            retirement.set()
            follower.join().cancel()
        assert queue.max_live == 1
    finally:
        queue.close()


def test_a_never_transaction_waits_for_every_live_transaction() -> None:
    queue = PipelineQueue(4)
    try:
        first, second = admit(queue), admit(queue, ALWAYS)
        never = Acquirer(queue, NEVER)
        first.set()
        assert queue.live() == 1
        assert not never.admitted.is_set()
        second.set()
        never.join().cancel()
    finally:
        queue.close()


def test_an_unchecked_check_fences_admission_until_it_completes(queue: PipelineQueue) -> None:
    checked, successor = admit(queue), admit(queue)
    done = threading.Event()
    queue.fence(done, UNCHECKED)  # before the checked transaction retires
    checked.set()
    successor.set()
    assert (queue.live(), queue.fences()) == (0, 1)
    blocked = Acquirer(queue)
    assert not blocked.admitted.is_set()
    done.set()
    blocked.join().cancel()
    assert queue.fences() == 0
    assert queue.max_live == 2  # the checked generation and one admitted successor


def test_an_always_check_releases_admission_once_it_holds_its_inputs(
    queue: PipelineQueue,
) -> None:
    checked = admit(queue, ALWAYS)
    done, acquired = threading.Event(), threading.Event()
    queue.fence(done, ALWAYS, acquired=acquired)
    checked.set()
    blocked = Acquirer(queue, ALWAYS)
    never = Acquirer(queue, NEVER)
    assert not blocked.admitted.is_set()
    acquired.set()
    blocked.join().register(threading.Event())  # overlaps the running check
    # A NEVER admission is fully sequential: it also waits for the running check.
    assert not never.admitted.is_set()
    assert queue.fences() == 1
    done.set()
    assert not never.admitted.wait(0.1)  # the ALWAYS successor is still live
    queue.close()
    with pytest.raises(ZKDVError, match="closed"):
        never.join()


def test_an_always_check_without_an_acquired_event_fences_until_done(
    queue: PipelineQueue,
) -> None:
    done = threading.Event()
    queue.fence(done, ALWAYS)
    blocked = Acquirer(queue, ALWAYS)
    assert not blocked.admitted.is_set()
    done.set()
    blocked.join().cancel()


def test_a_never_check_fences_until_it_completes(queue: PipelineQueue) -> None:
    checked = admit(queue, NEVER)
    done = threading.Event()
    queue.fence(done, NEVER, acquired=threading.Event())
    checked.set()
    blocked = Acquirer(queue, ALWAYS)
    assert not blocked.admitted.is_set()
    done.set()
    blocked.join().cancel()


@pytest.mark.parametrize(
    ("capacity", "policies", "bound"),
    [
        (3, [NEVER], 1),
        (3, [UNCHECKED], 3),
        (3, [ALWAYS], 3),
        (3, [ALWAYS, UNCHECKED, NEVER], 3),
        (1, [ALWAYS, UNCHECKED], 1),
    ],
)
def test_a_pipeline_run_never_exceeds_its_policy_bound(
    capacity: int, policies: list[Policy], bound: int
) -> None:
    rng = random.Random(capacity * 7 + len(policies))
    queue = PipelineQueue(capacity)
    lock = threading.Lock()
    live: dict[int, Policy] = {}
    violations: list[str] = []

    def commit(index: int, retirement: threading.Event, check: bool) -> int:
        done = threading.Event()
        if check:
            # A sampled check: fence first, then retire the transaction.
            queue.fence(done, live[index])
        with lock:
            del live[index]
        retirement.set()
        if check:
            queue.submit_check(done.set)
        return index

    committed: list[Future[int]] = []
    for index in range(40):
        policy = rng.choice(policies)
        admission = queue.acquire(policy, timeout=TIMEOUT)
        with lock:
            if NEVER in live.values() or (policy is NEVER and live):
                violations.append(f"{index}: {policy.name} beside {live}")
            live[index] = policy
        retirement = threading.Event()
        admission.register(retirement)
        committed.append(queue.submit_commit(commit, index, retirement, rng.random() < 0.2))
    queue.join()
    queue.close()
    assert violations == []
    assert [future.result() for future in committed] == list(range(40))
    assert 1 <= queue.max_live <= bound
    if policies == [NEVER]:
        assert queue.max_live == 1


def record(order: list[int], index: int) -> int:
    order.append(index)
    return index


def test_single_worker_stages_run_in_submission_order(queue: PipelineQueue) -> None:
    for submit in (queue.submit_start, queue.submit_commit, queue.submit_check):
        order: list[int] = []
        gate = threading.Event()
        submit(gate.wait, TIMEOUT)
        results = [submit(record, order, i) for i in range(50)]
        gate.set()
        assert [future.result(TIMEOUT) for future in results] == list(range(50))
        assert order == list(range(50))
    assert queue.submit_snapshot(sum, [1, 2, 3]).result(TIMEOUT) == 6


def test_prepare_runs_up_to_capacity_at_once(queue: PipelineQueue) -> None:
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    first = queue.submit_prepare(barrier.wait)
    second = queue.submit_prepare(barrier.wait)
    assert {first.result(TIMEOUT), second.result(TIMEOUT)} == {0, 1}


def test_a_failed_stage_poisons_the_queue_with_its_cause(queue: PipelineQueue) -> None:
    gate = threading.Event()
    ran: list[str] = []
    queue.submit_commit(gate.wait, TIMEOUT)

    def fail() -> None:
        raise ValueError("commitment failed")

    failed = queue.submit_commit(fail)
    skipped = queue.submit_commit(ran.append, "after")
    blocked = Acquirer(queue)  # live capacity is free, so this is admitted at once
    blocked.join().register(threading.Event())
    admit(queue)
    waiting = Acquirer(queue)
    assert not waiting.admitted.is_set()
    gate.set()

    assert isinstance(failed.exception(TIMEOUT), ValueError)
    poisoned = skipped.exception(TIMEOUT)
    assert isinstance(poisoned, ZKDVPoisonedError)
    assert ran == []  # work queued behind a failure never runs
    with pytest.raises(ZKDVPoisonedError, match="commitment failed") as caught:
        queue.check()
    assert isinstance(caught.value.__cause__, ValueError)
    assert queue.poisoned is caught.value.__cause__
    with pytest.raises(ZKDVPoisonedError):
        waiting.join()  # a blocked admission wakes up poisoned
    with pytest.raises(ZKDVPoisonedError):
        queue.acquire(UNCHECKED)
    with pytest.raises(ZKDVPoisonedError) as joined:
        queue.join()
    assert joined.value.__cause__ is caught.value.__cause__
    queue.join(raise_poison=False)


def test_the_first_failure_is_the_cause(queue: PipelineQueue) -> None:
    first, second = RuntimeError("first"), RuntimeError("second")
    queue.poison(first)
    queue.poison(second)
    with pytest.raises(ZKDVPoisonedError) as caught:
        queue.check()
    assert caught.value.__cause__ is first


def test_join_waits_for_work_submitted_by_other_stages(queue: PipelineQueue) -> None:
    checked = threading.Event()

    def commit() -> None:
        queue.submit_check(checked.set)

    queue.submit_commit(commit)
    queue.join()
    assert checked.is_set()
    queue.join()  # nothing pending: returns at once


def test_join_times_out_while_work_is_pending(queue: PipelineQueue) -> None:
    gate = threading.Event()
    queue.submit_commit(gate.wait, TIMEOUT)
    with pytest.raises(TimeoutError, match="1 pending"):
        queue.join(timeout=0.05)
    gate.set()
    queue.join(timeout=TIMEOUT)


def test_acquire_times_out(queue: PipelineQueue) -> None:
    admit(queue, NEVER)
    with pytest.raises(TimeoutError, match="UNCHECKED transaction timed out"):
        queue.acquire(UNCHECKED, timeout=0.05)
    assert queue.waiting() == 0


def test_close_is_idempotent_and_finishes_submitted_work() -> None:
    queue = PipelineQueue(2)
    gate = threading.Event()
    done: list[int] = []
    queue.submit_commit(gate.wait, TIMEOUT)
    queue.submit_commit(done.append, 1)
    gate.set()
    queue.close()
    queue.close()
    assert done == [1]
    assert queue.closed
    with pytest.raises(ZKDVError, match="closed"):
        queue.submit_commit(done.append, 2)
    with pytest.raises(ZKDVError, match="closed"):
        queue.acquire(UNCHECKED)
    queue.join()


def test_an_admission_is_released_when_the_step_fails(queue: PipelineQueue) -> None:
    with pytest.raises(KeyError), queue.acquire(UNCHECKED):
        raise KeyError("user error before the transaction started")
    assert queue.live() == 0
    admission = queue.acquire(NEVER)
    admission.cancel()
    admission.cancel()
    with pytest.raises(RuntimeError, match="already registered or cancelled"):
        admission.register(threading.Event())
    with queue.acquire(UNCHECKED) as kept:
        kept.register(threading.Event())
    assert queue.live() == 1


def test_stages_and_waits_are_annotated() -> None:
    names: list[str] = []

    @contextlib.contextmanager
    def record(name: str) -> Iterator[None]:
        names.append(name)
        yield

    queue = PipelineQueue(1, annotation=record)
    retirement = admit(queue)
    blocked = Acquirer(queue)
    retirement.set()
    blocked.join().cancel()
    for stage in ("start", "prepare", "commit", "check", "snapshot"):
        getattr(queue, f"submit_{stage}")(int).result(TIMEOUT)
    queue.close()
    assert "zkdv.flow_control.wait" in names
    assert [name for name in names if name != "zkdv.flow_control.wait"] == [
        "zkdv.start",
        "zkdv.prepare",
        "zkdv.commit",
        "zkdv.check",
        "zkdv.snapshot",
    ]


def test_register_without_acquire_still_counts(queue: PipelineQueue) -> None:
    retirement = threading.Event()
    queue.register(retirement, ALWAYS)
    queue.release(NEVER)  # nothing reserved: a no-op
    assert queue.live() == 1
    retirement.set()
    assert queue.live() == 0
