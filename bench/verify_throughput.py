"""Offline verification speed: step records per second, and the size of a step record.

    python bench/verify_throughput.py [--steps 200000]

Writes a transcript of ``--steps`` steps through the real :class:`~zkdv.core.ZKDVCore`
(a tiny state, so writing is quick; verification cost per record does not depend on the
state size), then times :func:`zkdv.verify.verify_transcript` without probes. Targets:
at least 100,000 step records per second, and a step record without probes <= 1 KiB.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from zkdv.config import SamplingPolicy, ZKDVConfig
from zkdv.core import ZKDVCore
from zkdv.records import RECORDS_FILE, iter_records
from zkdv.verify import verify_transcript


def write(path: Path, steps: int) -> None:
    core = ZKDVCore(
        path,
        ZKDVConfig(sampling_policy=SamplingPolicy(update_check_probability=0.0)),
        prover="whitebox-jax",
        rolling_window=4,
        probe_ratio=0.01,
        snapshot_interval=12,
        max_in_flight=2,
        experiment={"name": "bench/verify", "spec_digest": "0" * 64},
    )
    params = [("w", np.zeros((4, 4), np.float32))]
    state = [("count", np.zeros((), np.int32))]
    batch = np.arange(64, dtype=np.uint32).reshape(4, 16)
    core.open(params=params, opt_state=state, buffers=[], batch_cols=16, program=None)
    for step in range(steps):
        core.commit_step(
            step, batch=batch, params=params, opt_state=state, buffers=[], probes=None, flops=1e12
        )
    core.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        start = time.perf_counter()
        write(path, args.steps)
        written = time.perf_counter() - start
        sizes = [r.size for r in iter_records(path) if r.data.get("t") == "step"]
        start, cpu = time.perf_counter(), time.process_time()
        report = verify_transcript(path, probes=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert report.ok, report.summary()
        total = (path / RECORDS_FILE).stat().st_size
    print(f"wrote {args.steps} steps in {written:.1f} s ({total / 2**20:.1f} MiB)")
    print(
        f"step record size: max {max(sizes)} bytes, mean {sum(sizes) / len(sizes):.0f} bytes  (target <= 1024)"
    )
    print(
        f"verified in {elapsed:.2f} s: {args.steps / elapsed:,.0f} step records/s  (target >= 100,000)"
    )
    # On a quiet machine the two rates agree; when other processes share the cores the
    # wall-clock rate drops and the CPU-time rate shows what the verifier itself costs.
    print(
        f"CPU time {cpu:.2f} s: {args.steps / cpu:,.0f} step records per CPU-second; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
