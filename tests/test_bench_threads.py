"""bench/_threads.py counts each ZKDV thread's own CPU time, by stage, and nothing else's."""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np

from tests.bench_modules import load

PAGES = 256
threads = load("_threads")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_block_counts_each_zkdv_stage_s_cpu_and_not_other_threads() -> None:
    go, done = threading.Event(), threading.Event()

    def worker(seconds: float, burnt: threading.Event) -> None:
        go.wait()
        _burn(seconds)
        burnt.set()
        done.wait()  # alive when the block ends, as a pool's workers are

    # Stage names of their own: the test process may hold other tests' ZKDV threads.
    shares = {"zkdv-tcommit_0": 0.15, "zkdv-twriter_0": 0.05, "not-zkdv": 0.2}
    burnt = {name: threading.Event() for name in shares}
    pool = [
        threading.Thread(target=worker, args=(seconds, burnt[name]), name=name)
        for name, seconds in shares.items()
    ]
    for thread in pool:
        thread.start()
    totals = threads.CpuBreakdown()
    try:
        with totals.block(steps=5):
            go.set()
            _burn(0.05)
            for event in burnt.values():
                assert event.wait(30)
            # Fresh anonymous pages fault in when first written (a heap the process has
            # touched before may not: an allocator can reuse it).
            fresh = mmap.mmap(-1, PAGES * mmap.PAGESIZE)
            pages = np.frombuffer(fresh, dtype=np.uint8)
            pages[:: mmap.PAGESIZE] = 1
            del pages
            fresh.close()
    finally:
        done.set()
        for thread in pool:
            thread.join()

    total, stages = totals.per_step_ms()
    # Per step over 5 steps: 30 ms and 10 ms of CPU, give or take the clocks' reading.
    assert 29 <= stages["tcommit"] <= 40 and 9 <= stages["twriter"] <= 15
    assert all(ms > 0 for ms in stages.values())
    # The other thread's 40 ms per step is not counted (other tests' ZKDV threads idle).
    assert total - stages["tcommit"] - stages["twriter"] < 10
    assert totals.training >= 0.05
    assert totals.faults >= PAGES
    line = totals.line("zkdv", ("eager", threads.CpuBreakdown(steps=5)))
    assert "ZKDV's threads" in line and "tcommit 3" in line and "against eager" in line
