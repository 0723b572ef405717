"""ZKDV's worker threads: ``SCHED_IDLE`` while the training runs, normal while it waits.

The mode is decided once per process, so the environment variable's cases run in
subprocesses; the in-process tests use the default (``auto``) and skip where this
process may not raise a thread out of ``SCHED_IDLE``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests.agent.zkdv.test_flowcontrol import wait_until
from zkdv import merkle, workers
from zkdv.driver.flowcontrol import PipelineQueue

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")

TIMEOUT = 10.0


def _policy() -> int:
    return os.sched_getscheduler(0)


@pytest.fixture
def idle_workers() -> None:
    if not workers.idle():
        pytest.skip("this process may not raise a thread out of SCHED_IDLE")


@pytest.fixture
def queue(idle_workers: None) -> PipelineQueue:
    queue = PipelineQueue(1)
    yield queue
    queue.join()
    queue.close()


def test_a_stage_worker_is_raised_while_admission_waits_for_it(queue: PipelineQueue) -> None:
    first = queue.acquire()
    retired = threading.Event()
    first.register(retired)
    started = threading.Event()
    seen: list[int] = []

    def commit() -> None:
        seen.append(_policy())
        started.set()
        # The training thread now blocks in acquire() until this commitment retires.
        wait_until(lambda: _policy() == os.SCHED_OTHER)
        seen.append(_policy())
        retired.set()

    future = queue.submit_commit(commit)
    assert started.wait(TIMEOUT)
    queue.acquire(timeout=TIMEOUT).cancel()
    future.result(TIMEOUT)
    assert seen == [os.SCHED_IDLE, os.SCHED_OTHER]
    # The wait is over: the worker is idle again.
    assert queue.submit_commit(_policy).result(TIMEOUT) == os.SCHED_IDLE


def test_waits_nest_and_a_worker_started_during_one_is_demoted_after_it(
    queue: PipelineQueue,
) -> None:
    with workers.waiting():
        with workers.waiting():
            assert queue.submit_snapshot(_policy).result(TIMEOUT) == os.SCHED_OTHER
        # The outer wait still holds.
        assert queue.submit_snapshot(_policy).result(TIMEOUT) == os.SCHED_OTHER
    assert queue.submit_snapshot(_policy).result(TIMEOUT) == os.SCHED_IDLE


def test_a_worker_that_waits_raises_no_one(queue: PipelineQueue) -> None:
    # Only the training's waits raise the workers: a worker waiting on another (the
    # commit stage on the hashing pool) is not the training.
    committer = queue.submit_commit(threading.get_native_id).result(TIMEOUT)

    def wait_on_the_committer() -> int:
        with workers.waiting():
            return os.sched_getscheduler(committer)

    assert queue.submit_snapshot(wait_on_the_committer).result(TIMEOUT) == os.SCHED_IDLE


_CHILD = """
import os, sys
from zkdv import merkle, workers
from zkdv.driver.flowcontrol import PipelineQueue
if len(sys.argv) > 1:  # imported first: the interpreter may live where nobody can read
    os.setuid(int(sys.argv[1]))
queue = PipelineQueue(1)
policy = lambda: os.sched_getscheduler(0)
names = {os.SCHED_IDLE: "idle", os.SCHED_OTHER: "normal"}
running = names[queue.submit_commit(policy).result()]
with workers.waiting():
    waiting = names[queue.submit_commit(policy).result()]
queue.join()
queue.close()
print(workers.idle(), running, waiting)
"""


def _child(mode: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(workers.ENVIRONMENT, None)
    if mode is not None:
        env[workers.ENVIRONMENT] = mode
    return subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_normal_keeps_workers_at_the_training_priority() -> None:
    result = _child("normal")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "normal", "normal"]


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    result = _child("background")
    assert result.returncode != 0
    # Raised by PipelineQueue() on the calling thread, not by a worker's initializer.
    assert (
        "ValueError: ZKDV_WORKER_PRIORITY must be one of auto, idle, normal, got 'background'"
        in result.stderr
    )
    assert "BrokenThreadPool" not in result.stderr


def _unprivileged() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    return ["65534"]  # nobody


def test_auto_keeps_normal_priority_where_a_wait_could_not_raise_the_workers() -> None:
    # Without CAP_SYS_NICE and with RLIMIT_NICE below 20, the kernel refuses to raise a
    # thread out of SCHED_IDLE: a demoted worker could starve behind other processes.
    result = _child(None, *_unprivileged())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "normal", "normal"]


def test_idle_demotes_even_where_a_wait_cannot_raise_the_workers() -> None:
    result = _child("idle", *_unprivileged())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "idle", "idle"]


def test_auto_demotes_where_the_process_may_raise_them_back() -> None:
    result = _child(None)
    assert result.returncode == 0, result.stderr
    expected = "True idle normal" if workers.idle() else "False normal normal"
    assert result.stdout.split() == expected.split()


def test_the_hashing_pool_is_a_worker(idle_workers: None) -> None:
    assert merkle._pool().submit(_policy).result(TIMEOUT) == os.SCHED_IDLE
    with workers.waiting():
        assert merkle._pool().submit(_policy).result(TIMEOUT) == os.SCHED_OTHER


def test_a_forked_child_never_touches_the_parents_workers(queue: PipelineQueue) -> None:
    worker = queue.submit_commit(threading.get_native_id).result(TIMEOUT)
    assert os.sched_getscheduler(worker) == os.SCHED_IDLE
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        try:
            with workers.waiting():
                pass
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The child's wait raised nothing of the parent's: its worker is still idle.
    assert os.sched_getscheduler(worker) == os.SCHED_IDLE
