"""Honest runs with full snapshot windows, trained on other kernels: the drift test's false alarms.

``bench/cross_hardware.py`` replays the recipe tests' runs (8 steps, a snapshot every 4),
whose windows are too short for the drift test (``provers.drift``: a window's exact
sign-flip p-value cannot go below ``2^-(m-1)`` for ``m`` inexact steps). This bench
trains the forgery suite's honest LM run (``bench/forgery_suite.py``: 96 steps, a
snapshot every 12, the SDK's default policy), bf16-autocast and float32, in a fresh
process under each CPU kernel environment, and replays every window here, as a platform
worker on other hardware does. It prints per run: the windows, the smallest window
exact p-value, the largest window z and mean cosine, the run's combined z and the bound on
its p-value (``provers.drift.run_p``), and the false alarms
(a replay that rejects an honest run: there must be none).

    python bench/drift_honest.py                  # 6 environments x 2 precisions x 2 seeds
    python bench/drift_honest.py --seeds 1 --steps 48
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "agent" / "zkdv" / "src"),
    str(ROOT / "agent" / "dvbench" / "src"),
]

#: (kernel family, threads) the runs train under.
ENVIRONMENTS = tuple((family, threads) for family in ("default", "avx2") for threads in (1, 2, 4))


def _train(directory: Path, family: str, threads: int, seeds: int, steps: int) -> str:
    from zkdv.calibrate import kernels

    env = {**os.environ, **kernels(family), "PYTHONPATH": os.pathsep.join(sys.path[:3])}
    result = subprocess.run(
        [sys.executable, __file__, "--train", str(directory), str(threads), str(seeds), str(steps)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if result.returncode == 0 else result.stderr[-2000:]


def _train_here(directory: Path, threads: int, seeds: int, steps: int) -> None:
    import torch

    from bench import forgery_suite as suite

    torch.set_num_threads(threads)
    for seed in range(seeds):
        for autocast in (True, False):
            name = f"{'bf16' if autocast else 'fp32'}-{seed}"
            suite.train(
                directory / name, steps=steps, seed=seed, forger=suite.Forger(autocast=autocast)
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--train", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        where, threads, seeds, steps = args.train
        _train_here(Path(where), int(threads), int(seeds), int(steps))
        return 0
    import numpy as np
    import torch

    from provers import torch_replay
    from provers.drift import combine, sign_flip_p
    from provers.replay import Transcript, windows

    print(
        f"replaying on: torch kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    print(
        f"{'trained on':<28}{'run':<8}{'windows':>8}{'inexact':>8}{'window p':>9}"
        f"{'max z':>8}{'max cos':>9}{'run z':>8}{'run p':>9}  verdict",
        flush=True,
    )
    alarms = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for family, threads in ENVIRONMENTS:
            directory = Path(scratch) / f"{family}-{threads}"
            error = _train(directory, family, threads, args.seeds, args.steps)
            if error:
                print(f"  training failed ({family}, {threads}): {error}", flush=True)
                alarms += 1
                continue
            for path in sorted(p for p in directory.iterdir() if p.is_dir()):
                transcript = Transcript.load(path)
                transition = torch_replay.load_transition(path)
                drifts, failures, inexact = [], [], 0
                for first, last in windows(transcript):
                    verdict = torch_replay.verify_challenge(
                        path, first, through=last, transition=transition, exact=False
                    )
                    inexact += sum(not e.exact for e in verdict.evidence)
                    if verdict.drift is not None:
                        drifts.append(verdict.drift)
                    if not verdict.ok:
                        failures.append(f"{verdict.reason}: {verdict.message}")
                run = combine(drifts)
                if run["exceeded"]:
                    failures.append(f"run p {run['p']:.3g} <= {run['run_p']:g}")
                alarms += bool(failures)
                # Each window's own exact p-value (the window test needs 21 steps to use it).
                min_p = min(
                    (sign_flip_p(np.asarray(w["gram"])) for w in drifts if w.get("gram")),
                    default=1.0,
                )
                zs = [w["z"] for w in drifts if w.get("z") is not None]
                cosines = [w["cosine"] for w in drifts if w.get("cosine") is not None]
                run_z = "-" if run["z"] is None else f"{run['z']:.3g}"
                print(
                    f"{f'kernels={family} threads={threads}':<28}{path.name:<8}"
                    f"{len(windows(transcript)):>8}{inexact:>8}{min_p:>9.3g}"
                    f"{max(zs, default=0.0):>8.3g}{max(cosines, default=0.0):>9.3g}{run_z:>8}{run['p']:>9.3g}  "
                    f"{'FALSE ALARM ' + '; '.join(failures) if failures else 'passed'}",
                    flush=True,
                )
    print(f"{alarms} false alarms; {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
