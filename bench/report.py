"""Run the benchmarks and write ``docs/performance.md``: every bench, its command, its floor
and its figures from the last run, so the numbers in the docs are never older than a run.

    scripts/bench-report                      # every bench but the long sweeps
    scripts/bench-report --only torch_overhead,probe_cost
    scripts/bench-report --all                # the long sweeps too (an hour or more)
    scripts/bench-report --render             # rewrite the page from the stored runs
    scripts/bench-report --check              # exit 1 if the page is not what they render

Each run's output is kept in ``docs/performance.json`` with where and when it ran (the
commit, the CPU, the load average before and after, the seconds it took); the page is
rendered from that file alone, so a partial run (``--only``) replaces those benches'
sections and keeps the others with their own dates. The figures in the summary table are
the bench's own lines that compare against its floor or target (``headline``); the whole
output is in each bench's section.

Benches that need a PostgreSQL server (the API's) run when ``BENCH_DATABASE_URL`` names a
scratch database: ``load_profile`` flushes it.

The benches are timing measurements: run the report on a quiet machine (no test suite,
no other bench), and read each section's load average before trusting a figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "docs" / "performance.json"
PAGE = ROOT / "docs" / "performance.md"
#: Dated measurement diaries, rendered as they are written at the end of the page.
HISTORY = ROOT / "bench" / "history"
#: Lines of a bench's output kept in the store (its summary is at the end).
KEPT_LINES = 120
#: A bench's output lines that state a figure against its floor or target.
HEADLINE = re.compile(
    r"ratio|floor|target|goal|upload/|records/s|per hour|/hour|x float32|added by|- p=0|platform /",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...]
    measures: str
    floor: str
    database: bool = False
    long: bool = False
    #: The JAX platform it must run on (``"tpu"``): skipped elsewhere, and the page says so.
    device: str | None = None

    @property
    def command(self) -> str:
        return " ".join(("python", f"bench/{self.name}.py", *self.args))


BENCHES: tuple[Bench, ...] = (
    Bench(
        "torch_overhead",
        ("--recipe", "lm", "--rounds", "8"),
        "a Torch training step (the LM recipe: bf16 autocast, clipping, accumulation, "
        "schedule, dropout) plain and in a ZKDV transaction, at the default policy and p = 0",
        "the default policy's least added time per step (`bench/_floor.py`: hashing the "
        "post-update state, the snapshot copies, the expected replay of sampled checks)",
    ),
    Bench(
        # Not --quick: its blocks of 4 steps each end in a join, and the snapshot every
        # 12 steps then falls inside one block, which overstates a proof's step.
        "jax_overhead",
        (),
        "`jax.jit` against `proof.jit` on an LM and a state-heavy MLP, and the committed "
        "programs alone (no commitment) between them",
        "the same floor as Torch's, for the JAX state; with the committed programs' own "
        "added time and the step's exact probes' floor of exactness, the protocol's floor",
    ),
    Bench(
        "hf_trainer_overhead",
        ("--rounds", "5"),
        "a Hugging Face `Trainer` step with and without `zkdv.integrations.transformers.prove`",
        "the default policy's floor for the Trainer's state",
    ),
    Bench(
        "jax_nnx_scan",
        ("--rounds", "2"),
        "Flax NNX and `zkdv.jax.scan` under ZKDV beside plain JAX",
        "the plain step",
    ),
    Bench(
        "canonical_compile",
        (),
        "XLA's compile time for the canonical update (clipping + AdamW + warmup-cosine) "
        "beside plain Optax, over 4, 16 and 38 parameter leaves",
        "plain Optax's compile time; leaves of one shape share one program, so the LM "
        "recipe's 38 leaves of 9 shapes are the figure to watch",
    ),
    Bench(
        "probe_cost",
        (),
        "exact probe rows (Ozaki splitting) against a float32 product of the same rows",
        "the floor of exactness: the integer slices' products alone, the faster of a BLAS "
        "and the compiled pass's own dot products; and that floor with the split, which "
        "exactness needs too",
    ),
    Bench(
        "gradient_commit",
        ("--rounds", "3"),
        "what committing the gradient adds to a step's commitment work, and the canonical "
        "optimizer update against `torch.optim`",
        "the bytes hashed: (state + gradient) / state",
    ),
    Bench(
        "commit_throughput",
        ("--gib", "0.5"),
        "`commit_state` over a large state",
        "raw BLAKE3 with all threads, and a memory copy, over the same bytes",
    ),
    Bench(
        "device_commit",
        ("--mib", "64"),
        "device-side commitments against the host path (on this machine's CPU device "
        "unless a GPU is present; `--gpu-check` is the GPU script)",
        "a plain read of the same bytes on the device",
    ),
    Bench(
        "verify_throughput",
        ("--steps", "60000", "--rounds", "5"),
        "offline verification of a transcript, in step records per second",
        "none: a throughput, compared with an older verifier by `--baseline`",
    ),
    Bench(
        "replay_overhead",
        ("--quick",),
        "one replayed transition on the platform against the training step it checks",
        "the training step itself (target: at most 1.5 x)",
    ),
    Bench(
        "challenges_per_hour",
        (),
        "challenges verified per hour per worker, through the platform's replay path",
        "the replay's own compute per challenge",
    ),
    Bench(
        "scale_model",
        ("--measure",),
        "bytes and GPU-seconds of a whole-step and a sliced challenge at 7B, 70B and 405B, "
        "and the sliced prototype beside a whole-step replay here",
        "the whole-step challenge",
    ),
    Bench(
        "bench_api",
        ("--workers", "2", "--upload-mib", "1024", "--part-mib", "64"),
        "API latency under 50 clients, and uploads through gunicorn on local disk and S3",
        "a plain copy, copy + fsync, SHA-256, and the exchange's floor (raw TCP, the "
        "worker's two hashes, writes and syncs)",
        database=True,
    ),
    Bench(
        "load_uploads",
        (),
        "uploads under concurrent clients against gunicorn over PostgreSQL",
        "none: latencies and uploads per second",
        database=True,
    ),
    Bench(
        "load_profile",
        ("--requests", "200"),
        "one API request in-process: queries and milliseconds",
        "none: milliseconds per request",
        database=True,
    ),
    Bench(
        "cross_hardware",
        ("--seeds", "1"),
        "honest runs trained under one kernel environment and replayed under another",
        "zero false alarms",
        long=True,
    ),
    Bench(
        "drift_honest",
        ("--seeds", "1"),
        "honest 96-step runs trained under other kernel environments, every window "
        "replayed with the drift test",
        "zero false alarms",
        long=True,
    ),
    Bench(
        "forgery_suite",
        (),
        "forgeries from the literature against the LM recipe at the default policy",
        "the detection rate each attack's bound predicts",
        long=True,
    ),
    Bench(
        "tpu_overhead",
        # a cold first proof step compiles for about 445 s: one round fits a 600 s command
        ("--rounds", "1", "--policies", "0", "--steps", "6"),
        "`jax.jit` against `proof.jit` (p = 0 and the default policy) on a 135M-parameter "
        "bf16 transformer LM at sequence length 1024, and the device commitment alone",
        "goals: 1.05x plain on steps without a drawn check, the commitment 1.5x one read of "
        "the state from HBM (v5e: 819 GB/s). Floors measured on the v5e: BLAKE3 is "
        "compute-bound at 255 GB/s (3.2x one read); the step and its canonical update alone "
        "take 1.24x plain (device profile, `bench/history/tpu.md`)",
        device="tpu",
    ),
)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    head = result.stdout.strip() or "unknown"
    # The report's own output changes as it runs; anything else changed is named.
    generated = {str(path.relative_to(ROOT)) for path in (STORE, PAGE)}
    dirty = [
        line
        for line in subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
        if line[3:] not in generated
    ]
    return f"{head}+changes" if dirty else head


def run(bench: Bench) -> dict[str, Any]:
    """Run one bench; what the store keeps of it."""
    environment = dict(os.environ)
    if bench.database:
        environment["DATABASE_URL"] = os.environ["BENCH_DATABASE_URL"]
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    when = datetime.datetime.now(datetime.UTC)
    result = subprocess.run(
        [sys.executable, f"bench/{bench.name}.py", *bench.args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    lines = (result.stdout + result.stderr).rstrip().splitlines()
    return {
        "command": bench.command,
        "when": when.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(seconds),
        "returncode": result.returncode,
        "output": lines[-KEPT_LINES:],
    }


def headlines(entry: dict[str, Any]) -> list[str]:
    """The lines that state a figure against a floor or target. A bench that failed (a
    traceback, or an exit status other than 1) says so instead; one that exits 1 because
    a target is not met (as ``bench_api.py`` does), or that a time limit cut (124, 137),
    keeps its figures, with the exit status after them."""
    output = entry["output"]
    crashed = any(line.startswith("Traceback") for line in output)
    if entry["returncode"] in (124, 137) and not crashed:  # timeout(1) cut it: keep what it got to
        found = [line.strip() for line in output if HEADLINE.search(line)]
        return [*found, f"exit {entry['returncode']}: cut at its time limit before the end"]
    if entry["returncode"] not in (0, 1) or (entry["returncode"] == 1 and crashed):
        return [f"failed (exit {entry['returncode']}): {output[-1] if output else ''}"]
    found = [line.strip() for line in output if HEADLINE.search(line)]
    if entry["returncode"] != 0:
        found.append(f"exit {entry['returncode']}: a target not met")
    return found


def _has_platform(platform: str) -> bool:
    # In a child process: importing JAX here would hold a TPU the bench then cannot open.
    probe = "import jax, sys; sys.exit(0 if any(d.platform == sys.argv[1] for d in jax.devices()) else 1)"
    return (
        subprocess.run([sys.executable, "-c", probe, platform], capture_output=True).returncode == 0
    )


def render(store: dict[str, Any]) -> str:
    """The page, from the stored runs alone."""
    out = [
        "# Performance",
        "",
        "Every benchmark under `bench/`: what it measures, the floor it is measured "
        "against, the command, and the figures of its last run. Generated by "
        "`scripts/bench-report` from `docs/performance.json`, never edited by hand "
        "(`tests/test_bench_report.py` fails if the two differ). Each bench prints its "
        "figures side by side with its floor, measured in the same run; a figure is "
        "only as quiet as the machine was, so each section gives the load average "
        "before and after its run.",
        "",
        "To refresh a bench after a change: `scripts/bench-report --only NAME`; every "
        "bench but the long sweeps: `scripts/bench-report`; the sweeps too: `--all`.",
        "",
        "The page ends with the history: the dated measurement diaries of the frontends "
        "(`bench/history/`), rendered as they are written.",
        "",
        "| bench | measures | floor | last figures | last run |",
        "|---|---|---|---|---|",
    ]
    for bench in BENCHES:
        entry = store.get(bench.name)
        if entry is None:
            figures, ran = "not run yet", "never"
        else:
            found = headlines(entry)
            figures = "<br>".join(_cell(line) for line in found[:6]) or "see its section"
            ran = f"{entry['when'][:10]}, {entry['commit']}"
        out.append(
            f"| [`{bench.name}`](#{bench.name.replace('_', '-')}) | {_cell(bench.measures)} "
            f"| {_cell(bench.floor)} | {figures} | {ran} |"
        )
    for bench in BENCHES:
        out += ["", f"## {bench.name.replace('_', '-')}", ""]
        out += [f"`{bench.command}`", ""]
        out += [f"Measures {bench.measures}. Floor: {bench.floor}."]
        if bench.database:
            out += ["", "Needs PostgreSQL: `BENCH_DATABASE_URL` names a scratch database."]
        if bench.long:
            out += ["", "A long sweep: run by `scripts/bench-report --all` or `--only`."]
        if bench.device:
            out += ["", f"Runs on a {bench.device.upper()} only: elsewhere the report skips it."]
        entry = store.get(bench.name)
        if entry is None:
            out += ["", f"Not run yet: `scripts/bench-report --only {bench.name}`."]
            continue
        out += [
            "",
            f"Last run {entry['when']} at {entry['commit']} on {entry['machine']}, load "
            f"average {entry['load'][0]} before and {entry['load'][1]} after, "
            f"{entry['seconds']} s, exit status {entry['returncode']}.",
            "",
            "```text",
            *entry["output"],
            "```",
        ]
    for path in sorted(HISTORY.glob("*.md")):
        out += ["", *_demoted(path.read_text().rstrip("\n").split("\n"))]
    return "\n".join(out) + "\n"


def _demoted(lines: list[str]) -> list[str]:
    """A history file's lines with each heading one level down (its title becomes a
    section of the page); lines inside code blocks are kept as they are."""
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if line.startswith("#") and not fenced else line)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def load() -> dict[str, Any]:
    if not STORE.exists():
        return {}
    stored: dict[str, Any] = json.loads(STORE.read_text())
    return stored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated bench names")
    parser.add_argument("--all", action="store_true", help="the long sweeps too")
    parser.add_argument("--render", action="store_true", help="rewrite the page only")
    parser.add_argument("--check", action="store_true", help="is the page up to date?")
    args = parser.parse_args(argv)
    known = {bench.name: bench for bench in BENCHES}
    store = load()
    if args.check:
        if PAGE.exists() and PAGE.read_text() == render(store):
            return 0
        print(f"{PAGE.relative_to(ROOT)} is not what {STORE.name} renders: run --render")
        return 1
    if not args.render:
        if args.only:
            names = [name.strip() for name in args.only.split(",") if name.strip()]
            unknown = sorted(set(names) - set(known))
            if unknown:
                parser.error(f"no bench named {', '.join(unknown)}; known: {', '.join(known)}")
            chosen = [known[name] for name in names]
        else:
            chosen = [bench for bench in BENCHES if args.all or not bench.long]
        for bench in chosen:
            if bench.database and not os.environ.get("BENCH_DATABASE_URL"):
                print(f"{bench.name}: skipped, BENCH_DATABASE_URL is not set", flush=True)
                continue
            if bench.device and not _has_platform(bench.device):
                print(f"{bench.name}: skipped, JAX sees no {bench.device}", flush=True)
                continue
            print(f"{bench.name}: {bench.command}", flush=True)
            entry = run(bench)
            print(f"  {entry['seconds']} s, exit {entry['returncode']}", flush=True)
            for line in headlines(entry):
                print(f"  {line}", flush=True)
            store[bench.name] = entry
            # Saved after each bench: an interrupted report keeps what it measured.
            STORE.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
            PAGE.write_text(render(store))
    PAGE.write_text(render(store))
    return 0


if __name__ == "__main__":
    sys.exit(main())
