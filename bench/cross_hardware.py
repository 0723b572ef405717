"""Honest runs trained on one kernel environment, replayed by the platform's prover on another.

The sweep behind ``docs/reliability.md``, "Cross-hardware replay". Every run trains in a
fresh process under one environment (Torch: a CPU kernel family of ATen, oneDNN and MKL
together and a thread count, or the AOT Inductor program; JAX: an XLA instruction set
and the cores the process may use),
with the SDK's sampled check at every step, and is replayed window by window here, in
this process's environment, by the platform's prover. It prints, per recipe and
environment, the runs, the false alarms (a replay that rejects an honest run: there must
be none), how many replayed steps were bit for bit, and the worst divergence of a
recomputed gradient as a share of its bound. ``jax-scan`` is the digits model trained two
updates per call in a ``zkdv.jax.scan``, each update a step replayed on its own.

The sharded recipes (issue 56) train on several devices or processes and are replayed
here on one: ``jax-sharded-DxM`` on a ``data`` x ``model`` mesh of eight CPU devices in
one process, ``jax-2proc`` on two JAX processes of two devices each, ``fsdp2`` on two
gloo processes (FSDP2, AdamW, no clipping: the SDK refuses clipping under FSDP2). Under
every environment each also trains one forged run (a committed gradient 1 % larger than
the one the optimizer applied at one step; in ``jax-2proc`` a committed update with one
weight nudged by 2**-20), and the column "forged caught" counts the forgeries the replay
rejected at the forged step (there must be one per row).

    python bench/cross_hardware.py                       # every unsharded recipe, 3 seeds
    python bench/cross_hardware.py --recipes bn lm --seeds 1
    python bench/cross_hardware.py --recipes jax-sharded-4x2 fsdp2 --seeds 1 --environments 1
"""

from __future__ import annotations

import argparse
import math
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

TORCH_RECIPES = ("bn", "cnn", "hf", "lm", "hf-trainer", "lightning")
JAX_RECIPES = ("jax-digits", "jax-batchstats", "jax-lm", "jax-scan")
SHARDED_RECIPES = ("jax-sharded-8x1", "jax-sharded-4x2", "jax-sharded-2x4", "jax-2proc", "fsdp2")
JAX_STEPS = 12
#: The step each recipe's forged run forges: a committed gradient 1 % larger (recipes.py's
#: FORGED_STEP; fsdp_runs.py's ``gradient`` mode), or, in jax-2proc, a committed update
#: with one weight nudged by 2**-20 (multiprocess_runs.py's ``forged`` mode).
FORGED_STEP = {"fsdp2": 3, "jax-2proc": 3, **{recipe: 5 for recipe in SHARDED_RECIPES[:3]}}
#: Torch environments: (name, kernel family, threads, program kind).
TORCH_ENVIRONMENTS = (
    ("kernels=default threads=1", "default", 1, "torch.export"),
    ("kernels=default threads=2", "default", 2, "torch.export"),
    ("kernels=default threads=4", "default", 4, "torch.export"),
    ("kernels=avx2 threads=1", "avx2", 1, "torch.export"),
    ("kernels=avx2 threads=2", "avx2", 2, "torch.export"),
    ("kernels=avx2 threads=4", "avx2", 4, "torch.export"),
    ("aot-inductor (eager training, compiled replay)", "", 2, "aot-inductor"),
)
#: JAX environments: XLA's instruction set and the cores the process may use (XLA CPU's
#: bits depend on both).
JAX_ENVIRONMENTS = tuple(
    (f"isa={isa} cores={cores}", isa, cores, "")
    for isa in ("SSE4_2", "AVX", "AVX2")
    for cores in (1, 2)
)


def _train(directory: Path, recipe: str, seeds: int, environment: tuple[str, str, int, str]) -> str:
    """Train ``seeds`` runs of ``recipe`` in one fresh process under ``environment`` (into
    ``directory/<seed>``); returns its error output when it fails, else ''."""
    from zkdv.calibrate import kernels

    _, family, threads, kind = environment
    if recipe in ("fsdp2", "jax-2proc"):
        return _train_processes(directory, recipe, seeds, family, threads)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])}
    prefix: list[str] = []
    if recipe.startswith("jax-"):
        env["XLA_FLAGS"] = f"--xla_cpu_max_isa={family}"
        cores = sorted(os.sched_getaffinity(0))[:threads]
        prefix = ["taskset", "--cpu-list", ",".join(map(str, cores))]
        script = str(ROOT / "tests" / "agent" / "zkdv" / "jax" / "recipes.py")
        seeds_ = ",".join(str(seed) for seed in range(seeds))
        command = [script, str(directory), recipe[4:], str(JAX_STEPS), "3", seeds_]
        if recipe in FORGED_STEP:
            command.append("forge")
        if recipe.startswith("jax-sharded-"):
            # Eight devices in one process; programs lowered for this CPU only, as
            # tests/agent/zkdv/jax/test_jax_sharded.py does.
            env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
            env["ZKDV_JAX_EXPORT_PLATFORMS"] = ""
    else:
        env.update(kernels(family) if family else {})
        env["ZKDV_TORCH_PROGRAM"] = kind
        runs = [f"recipe:{recipe}:{seed}" for seed in range(seeds)]
        command = [
            "-m",
            "tests.agent.zkdv.torch.train_elsewhere",
            str(directory),
            str(threads),
            *runs,
        ]
    result = subprocess.run(
        [*prefix, sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if result.returncode == 0 else result.stderr[-2000:]


def _train_processes(directory: Path, recipe: str, seeds: int, family: str, threads: int) -> str:
    """Two processes per run: ``seeds`` honest runs into ``directory/<recipe>-<seed>`` and
    one forged into ``directory/<recipe>-forged``. ``fsdp2``: two gloo ranks of
    ``threads`` threads each on kernel family ``family``
    (tests/agent/zkdv/torch/fsdp_runs.py); ``jax-2proc``: two JAX processes of two
    devices (tests/agent/zkdv/jax/multiprocess_runs.py) on instruction set ``family``,
    both on the first ``threads`` cores."""
    from tests.agent.zkdv.jax import multiprocess_runs
    from tests.agent.zkdv.torch import fsdp_runs

    directory.mkdir()
    honest, forged = ("clean", "gradient") if recipe == "fsdp2" else ("replicated", "forged")
    runs = [(f"{recipe}-{seed}", honest, seed) for seed in range(seeds)]
    for name, mode, seed in [*runs, (f"{recipe}-forged", forged, 0)]:
        work = directory.parent / f"{directory.name}-{name}"
        work.mkdir(parents=True)
        if recipe == "fsdp2":
            result = fsdp_runs.train(work, mode, world=2, kernel=family, threads=threads, seed=seed)
            if result.returncode != 0:
                return result.stderr[-2000:]
        else:
            cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))
            try:
                ranks = multiprocess_runs.train(
                    work,
                    mode,
                    seed=seed,
                    env={"XLA_FLAGS": f"--xla_cpu_max_isa={family}"},
                    prefix=["taskset", "--cpu-list", cores],
                )
            except RuntimeError as error:
                return str(error)[-2000:]
            if any("error" in rank for rank in ranks):
                return repr(ranks)[-2000:]
        (work / "proof").rename(directory / name)
    return ""


def _replay(path: Path) -> tuple[bool, str, int, int, float, float | None]:
    """Every window by the platform's prover: (ok, message, steps, exact steps, worst
    margin, the run's combined drift z over its windows, ``provers.drift.combine``: None
    where no window had two inexact steps)."""
    import provers
    from provers.drift import combine
    from provers.replay import Transcript, windows

    transcript = Transcript.load(path)
    prover = provers.PROVERS[str(transcript.root["prover"])]
    module = __import__(prover, fromlist=["load_transition"])
    transition = module.load_transition(path)
    steps = exact = 0
    worst = 0.0
    drifts = []
    for first, last in windows(transcript):
        verdict = module.verify_challenge(path, first, through=last, transition=transition)
        if verdict.drift is not None:
            drifts.append(verdict.drift)
        if not verdict.ok:
            return False, str(verdict.message), steps, exact, worst, combine(drifts)["z"]
        for evidence in verdict.evidence:
            steps += 1
            exact += bool(evidence.exact)
            if evidence.gradient is not None:
                worst = max(worst, float(evidence.gradient["margin"]))
    run = combine(drifts)
    if run["exceeded"]:
        return False, f"the run's drift p {run['p']:.3g} <= {run['run_p']:g}", steps, exact, worst, run["z"]  # fmt: skip
    return True, "", steps, exact, worst, run["z"]


def _row(recipe: str, environment: str, directory: Path) -> tuple[int, int]:
    """Replay every run trained into ``directory`` and print the row: (false alarms,
    forgeries the replay missed or rejected at another step than the forged one)."""
    runs = failed = steps = exact = forged = caught = 0
    worst = 0.0
    drift: float | None = None
    for path in sorted(p for p in directory.iterdir() if p.is_dir()):
        ok, message, n, e, w, z = _replay(path)
        if path.name.endswith("-forged"):
            forged += 1
            if not ok and message.startswith(f"step {FORGED_STEP[recipe]}:"):
                caught += 1
            else:
                print(f"  FORGERY MISSED ({recipe}, {environment}): {message or 'accepted'}")
            continue
        runs += 1
        steps, exact, worst = steps + n, exact + e, max(worst, w)
        if z is not None:
            drift = max(drift if drift is not None else -math.inf, z)
        if not ok:
            failed += 1
            print(f"  FALSE ALARM ({recipe}, {environment}, {path.name}): {message}")
    print(
        f"{recipe:<16}{environment:<50}{runs:>5}{failed:>14}{steps:>7}"
        f"{exact:>7}{worst:>15.3g}"
        f"{'-' if drift is None else format(drift, '.3g'):>11}"
        f"{f'{caught}/{forged}' if forged else '-':>15}",
        flush=True,
    )
    return failed, forged - caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=[*TORCH_RECIPES, *JAX_RECIPES],
        choices=[*TORCH_RECIPES, *JAX_RECIPES, *SHARDED_RECIPES],
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-aot", action="store_true", help="skip the AOT Inductor runs")
    parser.add_argument("--environments", type=int, help="only each recipe's first N environments")
    args = parser.parse_args()
    import torch

    print(
        f"replaying on: torch kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; JAX's default instruction set, "
        f"{len(os.sched_getaffinity(0))} cores",
        flush=True,
    )
    print(
        f"{'recipe':<16}{'trained on':<50}{'runs':>5}{'false alarms':>14}"
        f"{'steps':>7}{'exact':>7}{'worst / bound':>15}{'max run z':>11}"
        f"{'forged caught':>15}",
        flush=True,
    )
    alarms = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for recipe in args.recipes:
            if recipe.startswith("jax-"):
                environments = list(JAX_ENVIRONMENTS)
            else:
                # An AOT Inductor program refuses random operators: the dropout recipes
                # (hf, lm, hf-trainer, lightning) have none.
                aot = not args.no_aot and recipe in ("bn", "cnn")
                environments = [e for e in TORCH_ENVIRONMENTS if aot or e[3] != "aot-inductor"]
            for environment in environments[: args.environments]:
                directory = Path(scratch) / f"{recipe}-{len(os.listdir(scratch))}"
                error = _train(directory, recipe, args.seeds, environment)
                if error:
                    print(f"  training failed ({recipe}, {environment[0]}): {error}")
                    alarms += 1
                    continue
                failed, missed = _row(recipe, environment[0], directory)
                alarms += failed + missed
    print(
        f"{alarms} false alarms or missed forgeries; {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
