"""Offline verification speed: step records per second, old verifier beside new.

    python bench/verify_throughput.py [--steps 200000] [--rounds 5] [--baseline REV]

Writes a transcript of ``--steps`` steps through the real :class:`~zkdv.core.ZKDVCore`
(a tiny state, so writing is quick; verification cost per record does not depend on the
state size; a snapshot record every 12 steps, as the frontends' default interval puts
them), then times :func:`zkdv.verify.verify_transcript` without probes, alternating in
one process with the verifier at git revision ``--baseline`` (default ``main``; the one
before issue 17's rules is ``423cb1a``, the last single-module one ``52ad281``), loaded
from ``git show`` into a module (or, since the verifier is a package, a package) of its
own. Both see the same bytes; each round verifies them once with each, and the medians
are compared. Targets: at least 100,000 step records per second, and a step record
without probes <= 1 KiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from zkdv.config import SamplingPolicy, ZKDVConfig
from zkdv.core import ZKDVCore
from zkdv.records import RECORDS_FILE, iter_records
from zkdv.verify import verify_transcript

REPO = Path(__file__).resolve().parent.parent
VERIFIER = "agent/zkdv/src/zkdv/verify"
#: The verifier before it became a package: one module.
VERIFIER_MODULE = f"{VERIFIER}.py"
BASELINE = "zkdv_verify_baseline"
SNAPSHOT_INTERVAL = 12


def write(path: Path, steps: int) -> None:
    core = ZKDVCore(
        path,
        ZKDVConfig(sampling_policy=SamplingPolicy(update_check_probability=0.0)),
        prover="whitebox-jax",
        rolling_window=4,
        probe_ratio=0.01,
        snapshot_interval=SNAPSHOT_INTERVAL,
        max_in_flight=2,
        experiment={"name": "bench/verify", "spec_digest": "0" * 64},
    )
    params = [("w", np.zeros((4, 4), np.float32))]
    state = [("count", np.zeros((), np.int32))]
    batch = np.arange(64, dtype=np.uint32).reshape(4, 16)
    core.open(params=params, opt_state=state, buffers=[], batch_cols=16, program=None)
    for step in range(steps):
        if step % SNAPSHOT_INTERVAL == 0:
            assert core.last_roots is not None
            core.record_snapshot(step, core.last_roots, {})
        core.commit_step(
            step, batch=batch, params=params, opt_state=state, buffers=[], probes=None, flops=1e12
        )
    core.close()


def git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout


def baseline(revision: str) -> tuple[ModuleType, str]:
    """The verifier at ``revision``, and the commit it resolved to.

    A package's modules import one another as ``zkdv.verify._...``; in the copy they
    import the copy's modules instead, so the baseline is the revision's code throughout.
    """
    commit = git("rev-parse", "--short", f"{revision}^{{commit}}").decode().strip()
    folder = Path(tempfile.mkdtemp(prefix="verify-baseline-"))
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{commit}:{VERIFIER}"], cwd=REPO, capture_output=True
    )
    if listed.returncode == 0:  # a package
        package = folder / BASELINE
        package.mkdir()
        for name in listed.stdout.decode().split():
            if name.endswith(".py"):
                source = git("show", f"{commit}:{VERIFIER}/{name}")
                renamed = source.replace(b"zkdv.verify.", f"{BASELINE}.".encode())
                (package / name).write_bytes(renamed)
        spec = importlib.util.spec_from_file_location(
            BASELINE, package / "__init__.py", submodule_search_locations=[str(package)]
        )
    else:
        file = folder / f"{BASELINE}.py"
        file.write_bytes(git("show", f"{commit}:{VERIFIER_MODULE}"))
        spec = importlib.util.spec_from_file_location(BASELINE, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, commit


def timed(verify: Callable[..., Any], data: bytes) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    report = verify(data, probes=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert report.ok, report.summary()
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="main", help="git revision of the old verifier")
    args = parser.parse_args()
    old, commit = baseline(args.baseline)
    same = (
        subprocess.run(["git", "diff", "--quiet", commit, "--", VERIFIER], cwd=REPO).returncode == 0
    )
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        start = time.perf_counter()
        write(path, args.steps)
        written = time.perf_counter() - start
        sizes = [r.size for r in iter_records(path) if r.data.get("t") == "step"]
        data = (path / RECORDS_FILE).read_bytes()
    print(f"wrote {args.steps} steps in {written:.1f} s ({len(data) / 2**20:.1f} MiB)")
    print(
        f"step record size: max {max(sizes)} bytes, mean {sum(sizes) / len(sizes):.0f} bytes  (target <= 1024)"
    )
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        # Alternate, so a change of load during the run meets both alike.
        runs["old"].append(timed(old.verify_transcript, data))
        runs["new"].append(timed(verify_transcript, data))
    note = "  (the same code as this tree's: pass --baseline REV)" if same else ""
    print(f"old: {VERIFIER} at {commit}{note}; new: this tree; {args.rounds} rounds each")
    rates = {}
    for name, samples in runs.items():
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        rates[name] = (args.steps / wall, args.steps / cpu)
        print(
            f"{name}: median {wall:.3f} s = {args.steps / wall:,.0f} step records/s, "
            f"{args.steps / cpu:,.0f} per CPU-second  (target >= 100,000)"
        )
    print(
        f"new / old: {rates['new'][0] / rates['old'][0]:.2f} wall, "
        f"{rates['new'][1] / rates['old'][1]:.2f} CPU; load average {os.getloadavg()[0]:.1f}"
    )
    # On a quiet machine wall and CPU rates agree; when other processes share the cores
    # the wall-clock rate drops and the CPU-time rate shows what the verifier itself costs.


if __name__ == "__main__":
    main()
