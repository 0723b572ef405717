"""ZKDV's worker threads run on the time the training leaves idle.

A step's commitment (hashing, probes, records), the transcript writer, snapshot writes
and sampled checks run on worker threads, overlapped with the next steps. On a machine
whose cores the training keeps busy (CPU training: PyTorch's and XLA's intra-op threads
on every core), a worker at normal priority takes its fair share of a core in the middle
of a parallel region, and the region waits for its slowest thread. Under Linux's
``SCHED_IDLE`` policy a worker runs only on a core no normal thread wants, and yields it
the moment one does: the same work then fills the gaps between the training's parallel
regions (docs/torch.md, "Where the pipeline's threads run", has the measurements).

A worker at ``SCHED_IDLE`` gets almost nothing while other processes keep every core
busy, so it is demoted only while the training does not wait for it. Wherever the
training thread blocks on ZKDV (admission, the mutation barrier, back-pressure, a
snapshot slot, ``join``), :func:`waiting` raises every worker back to normal priority for
the duration of the wait: ZKDV never runs slower than at normal priority, only the
overlap goes. Raising a thread out of ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` or an
``RLIMIT_NICE`` of 20 (``ulimit -e 20``); where the process has neither, the default
leaves its workers at normal priority.

``ZKDV_WORKER_PRIORITY`` chooses, for the whole process, read when the first worker
starts:

- ``auto`` (the default): ``SCHED_IDLE`` where a wait can raise the workers back;
- ``idle``: ``SCHED_IDLE`` even where it cannot (a machine that runs nothing else);
- ``normal``: workers at the training's own priority.

Elsewhere than Linux every mode is ``normal``. Threads that the training waits on every
step whatever happens (the device snapshot's dispatcher, the control plane's) are not
workers in this sense and keep normal priority.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["ENVIRONMENT", "demote", "idle", "waiting"]

ENVIRONMENT = "ZKDV_WORKER_PRIORITY"
_MODES = ("auto", "idle", "normal")

_lock = threading.Lock()
_mode: bool | None = None  # None: not decided yet; True: workers run at SCHED_IDLE
_reversible = False
_workers: dict[int, threading.Thread] = {}  # native thread id -> thread
_waiters = 0
_local = threading.local()


def _set(thread_id: int, *, idle: bool) -> None:
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    os.sched_setscheduler(thread_id, policy, os.sched_param(0))


def _probe() -> bool:
    """Whether this process may raise a thread out of ``SCHED_IDLE`` (tried on a throwaway
    thread, as the kernel decides: capabilities, ``RLIMIT_NICE``, user namespaces)."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            _set(0, idle=True)
            _set(0, idle=False)
        except OSError:
            result.append(False)
        else:
            result.append(True)

    thread = threading.Thread(target=attempt, name="zkdv-priority-probe")
    thread.start()
    thread.join()
    return result == [True]


def idle() -> bool:
    """Whether ZKDV's workers run at ``SCHED_IDLE`` in this process (decided once).

    Raises:
        ValueError: ``ZKDV_WORKER_PRIORITY`` is not one of ``auto``, ``idle``, ``normal``.
    """
    global _mode, _reversible
    decided = _mode
    if decided is not None:  # every wait asks: no lock once decided
        return decided
    with _lock:
        if _mode is None:
            choice = os.environ.get(ENVIRONMENT, "auto").strip().lower() or "auto"
            if choice not in _MODES:
                raise ValueError(
                    f"{ENVIRONMENT} must be one of {', '.join(_MODES)}, got {choice!r}"
                )
            supported = hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")
            _reversible = supported and choice != "normal" and _probe()
            _mode = supported and (choice == "idle" or (choice == "auto" and _reversible))
        return _mode


def demote() -> None:
    """Make the calling thread a worker: ``SCHED_IDLE`` unless the training is waiting.

    The ``initializer`` of ZKDV's worker pools. A no-op where workers run at normal
    priority.
    """
    _local.worker = True
    if not idle():
        return
    thread = threading.current_thread()
    with _lock:
        _workers[threading.get_native_id()] = thread
        if _waiters == 0 or not _reversible:
            _set(0, idle=True)


def _raise_all(*, idle: bool) -> None:
    """Set every live worker's policy (called under ``_lock``)."""
    for thread_id, thread in list(_workers.items()):
        if not thread.is_alive():
            del _workers[thread_id]
            continue
        try:
            _set(thread_id, idle=idle)
        except ProcessLookupError:  # it ended between the check and the call
            del _workers[thread_id]


def _forget_after_fork() -> None:
    """A forked child (a data loader's worker) has none of the parent's threads: it must
    never touch the parent's worker ids, nor wait for a lock one of them held at the fork."""
    global _lock, _waiters
    _lock = threading.Lock()
    _workers.clear()
    _waiters = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Wrap a wait of the training (any non-worker) thread on ZKDV's workers.

    While at least one such wait lasts, every worker runs at normal priority, so a
    worker the training waits for never queues behind other processes. A no-op on a
    worker thread, and where workers run at normal priority anyway.
    """
    global _waiters
    if getattr(_local, "worker", False) or not idle():
        yield
        return
    with _lock:
        _waiters += 1
        if _waiters == 1 and _reversible:
            _raise_all(idle=False)
    try:
        yield
    finally:
        with _lock:
            _waiters -= 1
            if _waiters == 0 and _reversible:
                _raise_all(idle=True)
