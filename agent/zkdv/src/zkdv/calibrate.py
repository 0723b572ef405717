"""``python -m zkdv calibrate PROOF_DIR``: how far honest replays of *your* step land.

The platform replays challenged steps on its own workers, never the machines a run
trained on; their gradients differ from the committed ones by rounding, and the run's
:class:`~zkdv.config.GradientBounds` must cover that with a margin. The defaults are
calibrated on the project's recipes (``docs/reliability.md``); this command measures it
for a lab's own step before the real run: train a few steps of it with ZKDV (the proof
directory keeps snapshots, batches and committed gradients), then

    python -m zkdv calibrate proof/

recomputes every committed step's gradient under other kernel environments that this
machine can produce, one subprocess each (Torch: the other CPU kernel families of ATen,
oneDNN and MKL, and other thread counts; JAX: XLA's other instruction sets,
``--xla_cpu_max_isa``), compares them with the committed ones exactly as the platform
does (:func:`zkdv.gradients.compare`), and prints for each environment the worst
divergence as a share of its bound, the measured maxima, their margin to the run's
bounds and bounds with a tenfold margin. It also checks that the optimizer applied to
the committed gradients reproduces the committed state bit for bit in every
environment, as the platform demands.

A run trained on an accelerator is replayed only on workers of its own platform kind,
where the platform requires the committed bits (``docs/operators.md``). On a TPU host,
the command also recomputes the run's steps on this machine's CPU (``JAX_PLATFORMS=cpu``,
each XLA instruction set): those rows are **for information**, the margin that CPU bounds
would need, never part of the exit status or of the suggested bounds.

Exit status: 0 every environment within the bounds, the state exact everywhere; 1 not;
2 usage or I/O error (no committed gradients, none kept as files, missing files).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zkdv.config import GradientBounds
from zkdv.environments import kind_of_backend, platform_kind
from zkdv.gradients import WHOLE, Comparison, compare
from zkdv.merkle import commit_state
from zkdv.replay import ReplayError, Transcript, Transition, roots

__all__ = [
    "Environment",
    "Measurement",
    "calibrate",
    "default_environments",
    "kernels",
    "measure",
    "report",
]

#: The frontend module whose ``load_transition`` rebuilds a run's step, per prover.
FRONTENDS = {"whitebox-torch": "zkdv.torch.replay", "whitebox-jax": "zkdv.jax.replay"}
#: A leaf whose replayed norm is below this share of the whole gradient's is rounding
#: noise (a bias in front of a normalisation): the ``total`` term bounds it, not ``tensor``.
REAL = 1e-3
#: The margin the suggested bounds keep over the measured maxima.
MARGIN = 10.0
#: The environment variable the worker reads its thread count from.
THREADS = "ZKDV_CALIBRATE_THREADS"


@dataclass(frozen=True)
class Environment:
    """One kernel environment: environment variables for a fresh process, and a thread
    count (None: the process's default)."""

    name: str
    variables: dict[str, str]
    threads: int | None = None


@dataclass
class Measurement:
    """One environment's recomputation of every committed step."""

    environment: Environment
    steps: int = 0
    exact: int = 0
    state_exact: bool = True
    margin: float = 0.0
    worst: dict[str, Any] | None = None
    #: The measured maxima: a real leaf's divergence over its norm, any leaf's over the
    #: whole gradient's norm, the part along the gradient over its norm (leaf or whole).
    tensor: float = 0.0
    total: float = 0.0
    scale: float = 0.0
    error: str | None = None
    #: The platform kind the environment's process computed on (its rows say it).
    platform_kind: str | None = None

    def informational(self, trained: str) -> bool:
        """Whether this environment is another platform kind than the run's ``trained``:
        the platform never replays the run there, so its margins are for information."""
        return self.platform_kind is not None and self.platform_kind != trained


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: Torch's CPU kernel families, and the instruction sets that cap its math libraries to
#: the same: ATen's own kernels, oneDNN's (convolutions, bfloat16 matrix products) and
#: MKL's, which ``ATEN_CPU_CAPABILITY`` alone does not reach.
KERNELS = {
    "default": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}


def kernel_families(flags: set[str] | None = None) -> list[str]:
    """The Torch CPU kernel families this CPU runs, from its ``/proc/cpuinfo`` flags.

    ``ATEN_CPU_CAPABILITY`` is obeyed without a check: a family the CPU lacks dies of an
    illegal instruction rather than falling back.
    """
    flags = _cpu_flags() if flags is None else flags
    families = ["default"]
    if "avx2" in flags:
        families.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        families.append("avx512")
    return families


def kernels(capability: str) -> dict[str, str]:
    """The environment variables of a Torch process on CPU kernel family ``capability``."""
    return {"ATEN_CPU_CAPABILITY": capability, **KERNELS[capability]}


def default_environments(root: dict[str, Any]) -> list[Environment]:
    """The environments this machine can produce besides the run's own.

    Torch: every CPU kernel family the CPU supports (``default``, ``avx2``, ``avx512``:
    ATen's, oneDNN's and MKL's kernels together, :func:`kernels`) at the run's thread
    count, and one and twice that many threads. JAX: every XLA instruction set the CPU
    supports (none for an accelerator's run that a CPU cannot run: :func:`cpu_unavailable`).
    """
    env = root.get("env") or {}
    flags = _cpu_flags()
    out: list[Environment] = []
    if root.get("prover") == "whitebox-torch":
        threads = int(env.get("threads") or 1)
        trained = str(env.get("cpu_capability") or "").lower()
        for capability in kernel_families(flags):
            if capability != trained:
                out.append(Environment(f"kernels={capability}", kernels(capability), threads))
        for count in sorted({1, 2 * threads} - {threads}):
            out.append(Environment(f"threads={count}", {}, count))
    elif not cpu_unavailable(root):
        isas = ["SSE4_2", "AVX"]
        if "avx2" in flags:
            isas.append("AVX2")
        if "avx512f" in flags:
            isas.append("AVX512")
        on_cpu = platform_kind(root) == "cpu"
        trained = str(env.get("cpu_isa") or "").upper() if on_cpu else ""
        for isa in isas:
            if isa != trained:
                flag = f"--xla_cpu_max_isa={isa}"
                if on_cpu:
                    out.append(Environment(flag, {"XLA_FLAGS": flag}))
                else:  # an accelerator's run on this machine's CPU: for information
                    variables = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flag}
                    out.append(Environment(f"cpu {flag}", variables))
    return out


def cpu_unavailable(root: dict[str, Any]) -> str | None:
    """Why this machine's CPU cannot recompute an accelerator's JAX run, or None.

    The CPU rows of a TPU run run its exported programs on the CPU backend, so they need
    programs exported for ``cpu`` too (the default; ``ZKDV_JAX_EXPORT_PLATFORMS`` can
    leave it out).
    """
    if root.get("prover") == "whitebox-torch" or platform_kind(root) == "cpu":
        return None
    platforms = (root.get("env") or {}).get("export_platforms")
    if isinstance(platforms, list) and "cpu" not in platforms:
        return (
            f"no CPU rows: the run's programs were exported for {', '.join(platforms)} "
            "only (ZKDV_JAX_EXPORT_PLATFORMS), so a CPU cannot run them; train with cpu "
            "among the export platforms to see the CPU's margins for information"
        )
    return None


def _failure(stderr: str) -> str:
    """The line of a failed worker's stderr that says what failed: the last one, less
    JAX's note that it shortened the traceback (it follows the error, under a rule)."""
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip().strip("-") and "JAX has removed its internal frames" not in line
    ]
    return lines[-1] if lines else "(no output)"


def _transition(transcript: Transcript) -> Transition:
    name = FRONTENDS.get(str(transcript.root.get("prover")))
    if name is None:
        raise ReplayError(
            "unknown_prover", f"no replay module for prover {transcript.root.get('prover')!r}"
        )
    transition: Transition = importlib.import_module(name).load_transition(transcript.path)
    if transition.compute is None or transition.apply is None:
        raise ReplayError(
            "unsupported_program", "the run's step cannot be split into gradient and optimizer"
        )
    return transition


def _windows(transcript: Transcript, steps: int) -> Iterator[tuple[int, list[int]]]:
    """``(snapshot step, steps replayed from it)`` over the first ``steps`` steps."""
    starts = sorted(transcript.snapshots)
    last = min(max(transcript.steps, default=-1), steps - 1)
    for first, following in zip(starts, [*starts[1:], last + 1], strict=True):
        if first > last:
            break
        yield first, list(range(first, min(following, last + 1)))


def _stats(comparison: Comparison) -> dict[str, float]:
    """The measured maxima of one step (:class:`Measurement`)."""
    total = next((leaf.norm for leaf in comparison.leaves if leaf.path == WHOLE), 0.0)
    tensor = whole = scale = 0.0
    for leaf in comparison.leaves:
        if leaf.path == WHOLE:
            scale = max(scale, leaf.divergence / total if total else 0.0)
            continue
        if not leaf.path.startswith("params:"):
            continue
        real = leaf.norm >= REAL * total
        if leaf.test == "norm":
            whole = max(whole, leaf.divergence / total if total else 0.0)
            if real:
                tensor = max(tensor, leaf.divergence / leaf.norm)
        elif real:
            scale = max(scale, leaf.divergence / leaf.norm)
    return {"tensor": tensor, "total": whole, "scale": scale}


def measure(
    proof_dir: str | os.PathLike[str], steps: int, threads: int | None = None
) -> Iterator[dict[str, Any]]:
    """Recompute the first ``steps`` committed steps here: one JSON-able row each.

    Each row holds the step, the platform kind it was computed on, whether the
    recomputed values are bitwise the committed ones, whether the optimizer on the
    committed values gave the committed state bit for bit, the comparison's margin and
    worst test, and the measured maxima. ``threads`` sets Torch's thread count (a JAX
    run's CPU threads are XLA's, fixed per process).

    Raises:
        ReplayError: the run commits no gradients, or a file is missing or does not
            match its commitment.
    """
    transcript = Transcript.load(proof_dir)
    if transcript.grad is None:
        raise ReplayError(
            "no_gradients",
            "the run commits no gradients (schema.grad): nothing to calibrate; it was written "
            "before committed gradients or by a frontend path without them",
        )
    bounds = transcript.bounds
    prover = str(transcript.root.get("prover"))
    if threads is not None and prover == "whitebox-torch":
        import torch

        torch.set_num_threads(threads)
    transition = _transition(transcript)
    here = _local_kind(prover)
    chunk = transcript.config.chunk_bytes
    assert transition.compute is not None and transition.apply is not None
    for start, window in _windows(transcript, steps):
        state = transcript.snapshot(start)
        for k in window:
            record = transcript.steps[k]
            committed = transcript.committed_computed(k)
            comparison = compare(
                transition.compute(*state, transcript.batch(k), record), committed, bounds
            )
            params, opt_state, buffers, _ = transition.apply(*state, committed, record)
            replayed = tuple(
                commit_state(tree, chunk).root for tree in (params, opt_state, buffers)
            )
            worst = comparison.worst
            yield {
                "step": k,
                "platform_kind": here,
                "exact": comparison.exact,
                "state_exact": replayed == roots(record["post"]),
                "margin": comparison.margin,
                "worst": None if worst is None or worst.exact else worst.to_dict(),
                **_stats(comparison),
            }
            state = (params, opt_state, buffers)


def _local_kind(prover: str) -> str:
    """The platform kind this process computes on: JAX's default backend (Torch's
    replay module computes on the CPU)."""
    if prover != "whitebox-jax":
        return "cpu"
    import jax

    return kind_of_backend(jax.default_backend())


def _worker(proof: Path, steps: int, out: TextIO) -> int:
    threads = os.environ.get(THREADS)
    try:
        for row in measure(proof, steps, int(threads) if threads else None):
            out.write(json.dumps(row) + "\n")
            out.flush()
    except ReplayError as error:
        out.write(json.dumps({"error": error.reason, "message": error.message}) + "\n")
        return 1
    return 0


def _run(proof: Path, steps: int, environment: Environment) -> Measurement:
    """Recompute in a fresh process with ``environment`` applied."""
    variables = {**os.environ, **environment.variables}
    if environment.threads is not None:
        variables[THREADS] = str(environment.threads)
    result = subprocess.run(
        [sys.executable, "-m", "zkdv", "calibrate", str(proof), "--worker", "--steps", str(steps)],
        env=variables,
        capture_output=True,
        text=True,
        check=False,
    )
    measurement = Measurement(environment)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        if "error" in row:
            measurement.error = f"{row['error']}: {row['message']}"
            return measurement
        measurement.steps += 1
        measurement.platform_kind = row.get("platform_kind")
        measurement.exact += bool(row["exact"])
        measurement.state_exact &= bool(row["state_exact"])
        if row["margin"] >= measurement.margin:
            measurement.margin, measurement.worst = row["margin"], row["worst"]
        for key in ("tensor", "total", "scale"):
            setattr(measurement, key, max(getattr(measurement, key), row[key]))
    if result.returncode != 0 and measurement.error is None:
        measurement.error = f"the worker failed: {_failure(result.stderr)}"
    return measurement


def _suggest(value: float) -> float:
    """``MARGIN`` times ``value``, rounded up to one significant digit (0 stays 0)."""
    if value <= 0:
        return 0.0
    scaled = value * MARGIN
    magnitude = 10.0 ** math.floor(math.log10(scaled))
    return math.ceil(scaled / magnitude) * magnitude


def calibrate(
    proof: Path, environments: Sequence[Environment], steps: int, out: TextIO
) -> tuple[int, list[Measurement]]:
    """Measure every environment and print the table; returns (exit status, measurements)."""
    transcript = Transcript.load(proof)
    if transcript.grad is None:
        print(
            f"zkdv calibrate: {proof} commits no gradients (schema.grad): nothing to calibrate",
            file=out,
        )
        return 2, []
    if not transcript.keeps_gradient_files:
        print(
            f"zkdv calibrate: {proof} keeps no gradient files (config.gradient_files "
            "'never', a TPU's default): nothing to compare with; train the calibration "
            "steps with ZKDVConfig(gradient_files='always')",
            file=out,
        )
        return 2, []
    bounds = transcript.bounds
    env = transcript.root.get("env") or {}
    precision = (env.get("precision") or {}).get("kind", "unknown")
    count = min(len(transcript.steps), steps)
    print(
        f"calibrating {proof}: {transcript.root.get('prover')}, {precision} gradient program, "
        f"{count} committed steps; bounds tensor {bounds.tensor:g}, total {bounds.total:g}, "
        f"scale {bounds.scale:g}",
        file=out,
    )
    trained = Environment("as trained (here)", {}, env.get("threads"))
    measurements = [_run(proof, steps, e) for e in (trained, *environments)]
    return report(measurements, bounds, platform_kind(transcript.root), out), measurements


def report(
    measurements: Sequence[Measurement], bounds: GradientBounds, trained: str, out: TextIO
) -> int:
    """Print the table, the maxima and the suggested bounds; returns the exit status.

    ``trained`` is the run's platform kind. A measurement on another kind is for
    information only (:meth:`Measurement.informational`): its gradient margin neither
    fails the command nor enters the suggested bounds. The state must be exact in every
    environment all the same, for the canonical update promises it on any hardware.
    """
    width = max(len(m.environment.name) for m in measurements) + 2
    print(
        f"\n{'environment':<{width}}{'steps':>6}{'exact':>7}{'state':>7}  "
        f"{'worst / bound':>13}  worst test",
        file=out,
    )
    status = 0
    for m in measurements:
        if m.error is not None:
            print(f"{m.environment.name:<{width}}  error: {m.error}", file=out)
            status = max(status, 2)
            continue
        worst = m.worst
        where = "-" if worst is None else f"{worst['path']} ({worst['test']})"
        if m.informational(trained):
            where += f"  (on {m.platform_kind}: for information)"
        state = "exact" if m.state_exact else "DIFFERS"
        print(
            f"{m.environment.name:<{width}}{m.steps:>6}{m.exact:>7}{state:>7}  "
            f"{m.margin:>13.3g}  {where}",
            file=out,
        )
        if not m.state_exact or (m.margin > 1 and not m.informational(trained)):
            status = max(status, 1)
    valid = [m for m in measurements if m.error is None]
    own = [m for m in valid if not m.informational(trained)]
    other = [m for m in valid if m.informational(trained)]
    if own:
        measured = _maxima(own)
        print("\nmeasured maxima and their margin to the run's bounds:", file=out)
        _print_maxima(measured, bounds, out)
        suggested = {key: _suggest(value) for key, value in measured.items()}
        print(
            f"bounds with a {MARGIN:g}x margin over these maxima: "
            + ", ".join(f"{key}={value:g}" for key, value in suggested.items())
            + "  (zkdv.GradientBounds; a maximum of 0 means no environment here differed)",
            file=out,
        )
    else:
        print(
            f"\nno environment here computed on a {trained}, the run's platform kind: run "
            f"this command on a {trained} host to measure what the platform's replay judges",
            file=out,
        )
    if other:
        kinds = ", ".join(sorted({str(m.platform_kind) for m in other}))
        print(
            f"\nfor information, {trained} against {kinds} (the platform replays a {trained} "
            f"run on {trained} workers only and requires its bits there, so it never applies "
            "these margins; the state must still be exact):",
            file=out,
        )
        _print_maxima(_maxima(other), bounds, out)
    if status == 1:
        print(
            "\nSome environment exceeds the run's bounds or does not reproduce the state: the "
            "platform's replay on such hardware would reject this honest run.",
            file=out,
        )
    return status


def _maxima(measurements: Sequence[Measurement]) -> dict[str, float]:
    return {
        key: max((getattr(m, key) for m in measurements), default=0.0)
        for key in ("tensor", "total", "scale")
    }


def _print_maxima(measured: dict[str, float], bounds: GradientBounds, out: TextIO) -> None:
    for key, value in measured.items():
        bound = getattr(bounds, key)
        margin = f"{bound / value:.3g}x" if value > 0 else "bitwise equal"
        print(f"  {key:<7} {value:.3g}   bound {bound:g}   margin {margin}", file=out)


def main(proof: Path, *, worker: bool, steps: int, environments: Sequence[str]) -> int:
    """The command (``python -m zkdv calibrate``); see the module docstring."""
    if worker:
        return _worker(proof, steps, sys.stdout)
    try:
        transcript_root = Transcript.load(proof).root
    except ReplayError as error:
        print(f"zkdv calibrate: {error.message}", file=sys.stderr)
        return 2
    try:
        chosen = (
            [_parse(spec) for spec in environments]
            if environments
            else default_environments(transcript_root)
        )
    except ValueError as error:
        print(f"zkdv calibrate: {error}", file=sys.stderr)
        return 2
    skipped = None if environments else cpu_unavailable(transcript_root)
    if skipped:
        print(f"zkdv calibrate: {skipped}")
    status, _ = calibrate(proof, chosen, steps, sys.stdout)
    return status


def _parse(spec: str) -> Environment:
    """``"NAME=VALUE ... threads=N"`` as an :class:`Environment`."""
    variables: dict[str, str] = {}
    threads = None
    for item in spec.split():
        name, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--env {spec!r}: {item!r} is not NAME=VALUE")
        if name == "threads":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--env {spec!r}: threads must be a positive integer")
            threads = int(value)
        else:
            variables[name] = value
    return Environment(spec, variables, threads)
