"""bench/_threads.py counts each ZKDV thread's own CPU time, by stage, and nothing else's."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _threads() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_threads", ROOT / "bench" / "_threads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


threads = _threads()


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

    shares = {"zkdv-commit_0": 0.15, "zkdv-writer_0": 0.05, "not-zkdv": 0.2}
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
            # A fresh allocation of many pages is faulted in when first written (under
            # 4 MiB: NumPy asks for huge pages above that, which fault 2 MiB at a time).
            np.ones(3 << 20, dtype=np.uint8)
    finally:
        done.set()
        for thread in pool:
            thread.join()

    total, stages = totals.per_step_ms()
    assert set(stages) == {"commit", "writer"}
    # Per step over 5 steps: 30 ms and 10 ms of CPU, give or take the clocks' reading.
    assert 29 <= stages["commit"] <= 40 and 9 <= stages["writer"] <= 15
    assert total == stages["commit"] + stages["writer"]
    assert totals.training >= 0.05
    assert totals.faults >= (3 << 20) // 4096 // 2
    line = totals.line("zkdv", ("eager", threads.CpuBreakdown(steps=5)))
    assert "ZKDV's threads" in line and "commit 3" in line and "against eager" in line
