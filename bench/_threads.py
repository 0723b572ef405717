"""Where a benchmark block's CPU time went: ZKDV's own threads, the training thread, faults.

A step-time ratio on a small shared machine moves by more than the overhead it measures
(docs/performance.md). The CPU time of ZKDV's worker threads does not: each thread's CPU
clock (``pthread_getcpuclockid``) counts only that thread's work, in nanoseconds, whatever
else the machine runs. On a machine whose cores the training keeps busy, that work is
paid in step time, so these figures say what ZKDV adds with far less noise than the
ratio, and which stage adds it. Minor page faults per step (``getrusage``) show memory
that the allocator handed back to the kernel and the step had to fault in again.

Linux and glibc only (the benchmarks' machines); elsewhere the stages read as empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CpuBreakdown"]

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _CPU_CLOCK = _LIBC.pthread_getcpuclockid
    _CPU_CLOCK.argtypes = [ctypes.c_ulong, ctypes.POINTER(ctypes.c_int)]
except (OSError, AttributeError):  # not glibc
    _CPU_CLOCK = None

#: Worker threads are named ``zkdv-<stage>`` or ``zkdv-<stage>_<n>`` (a pool's workers).
_PREFIX = "zkdv-"


def _zkdv_threads() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every live ZKDV thread: ``{ident: (stage, seconds)}``.

    Read while the benchmark's ZKDV objects are open: their pools' threads live until
    ``close()``, so none ends between being listed and being read.
    """
    seconds: dict[int, tuple[str, float]] = {}
    if _CPU_CLOCK is None:
        return seconds
    for thread in threading.enumerate():
        if not thread.name.startswith(_PREFIX) or thread.ident is None:
            continue
        clock = ctypes.c_int()
        if _CPU_CLOCK(thread.ident, ctypes.byref(clock)) != 0:
            continue
        try:
            used = time.clock_gettime(clock.value)
        except OSError:  # the thread ended meanwhile
            continue
        seconds[thread.ident] = (thread.name.split("_")[0].removeprefix(_PREFIX), used)
    return seconds


@dataclass
class CpuBreakdown:
    """One variant's CPU time and page faults, summed over its timed blocks."""

    steps: int = 0
    training: float = 0.0  # CPU seconds of the thread that ran the steps
    faults: int = 0  # minor page faults of the whole process
    stages: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextlib.contextmanager
    def block(self, steps: int) -> Iterator[None]:
        """Add one timed block of ``steps`` steps (run in the training thread)."""
        threads = _zkdv_threads()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        training = time.thread_time()
        yield
        self.training += time.thread_time() - training
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        self.steps += steps
        for ident, (stage, seconds) in _zkdv_threads().items():
            used = seconds - threads.get(ident, (stage, 0.0))[1]
            if used > 0:  # an idle thread (another run's pool, say) adds no stage
                self.stages[stage] += used

    def per_step_ms(self) -> tuple[float, dict[str, float]]:
        """ZKDV's threads' CPU ms per step in all, and by stage (largest first)."""
        stages = {
            stage: seconds * 1e3 / self.steps
            for stage, seconds in sorted(self.stages.items(), key=lambda item: -item[1])
        }
        return sum(stages.values()), stages

    def line(
        self,
        label: str,
        baseline: tuple[str, CpuBreakdown] | None = None,
        caller: str = "training thread",
    ) -> str:
        """One report line; ``baseline`` is the plain variant's (label, breakdown), and
        ``caller`` names the thread that ran the steps."""
        total, stages = self.per_step_ms()
        parts = ", ".join(f"{stage} {ms:.2f}" for stage, ms in stages.items() if ms >= 0.005)
        training = self.training * 1e3 / self.steps
        faults = self.faults / self.steps
        text = f"  {label:14s} ZKDV's threads {total:6.2f} ms CPU/step"
        text += f" ({parts})" if parts else ""
        text += f"; {caller} {training:7.1f} ms CPU/step"
        if baseline is not None:
            name, plain = baseline
            text += f" ({training - plain.training * 1e3 / plain.steps:+.1f} against {name})"
        return text + f"; {faults:,.0f} minor page faults/step"
