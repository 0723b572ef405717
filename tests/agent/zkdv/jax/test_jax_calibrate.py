"""``python -m zkdv calibrate`` on JAX runs: the environments it measures, and how an
accelerator's run is judged against the CPU (for information, never a verdict)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable

import optax
from jax_helpers import apply_fn, batches, init_params, train_step

import zkdv
from zkdv.calibrate import (
    THREADS,
    Environment,
    Measurement,
    _failure,
    cpu_unavailable,
    default_environments,
    report,
)
from zkdv.config import GradientBounds
from zkdv.jax.contrib import TrainState

#: A bf16 run's bounds, as a TPU's LM recipe records them.
BOUNDS = GradientBounds(tensor=0.025, total=0.001, scale=0.003)


def _root(kind: str) -> dict[str, object]:
    return {"prover": "whitebox-jax", "env": {"platform_kind": kind, "cpu_isa": "AVX2"}}


def test_a_cpu_runs_environments_are_this_cpus_other_instruction_sets() -> None:
    environments = default_environments(_root("cpu"))
    assert environments, "every x86 CPU offers SSE4_2 and AVX besides AVX2"
    assert all(set(e.variables) == {"XLA_FLAGS"} for e in environments)
    assert "--xla_cpu_max_isa=AVX2" not in {e.name for e in environments}  # the run's own


def test_an_accelerators_run_is_also_measured_on_this_machines_cpu() -> None:
    environments = default_environments(_root("tpu"))
    assert [e.name for e in environments][:2] == [
        "cpu --xla_cpu_max_isa=SSE4_2",
        "cpu --xla_cpu_max_isa=AVX",
    ]
    assert all(e.variables["JAX_PLATFORMS"] == "cpu" for e in environments)
    # The run's instruction set is a CPU's; on a TPU run every CPU set is another machine.
    assert "cpu --xla_cpu_max_isa=AVX2" in {e.name for e in environments}


def _measured(name: str, kind: str, margin: float, *, state_exact: bool = True) -> Measurement:
    measurement = Measurement(Environment(name, {}), steps=4, platform_kind=kind)
    measurement.exact = 4 if margin == 0 else 0
    measurement.margin, measurement.state_exact = margin, state_exact
    measurement.total = measurement.tensor = measurement.scale = margin * 1e-3
    return measurement


def _report(*measurements: Measurement) -> tuple[int, str]:
    out = io.StringIO()
    return report(measurements, BOUNDS, "tpu", out), out.getvalue()


def test_the_cpus_margins_of_a_tpu_run_are_for_information_only() -> None:
    status, text = _report(_measured("as trained (here)", "tpu", 0), _measured("cpu", "cpu", 37))
    assert status == 0, text
    assert "(on cpu: for information)" in text
    # The suggested bounds come from the TPU's own replays, which were exact.
    assert "bounds with a 10x margin over these maxima: tensor=0, total=0, scale=0" in text
    assert "for information, tpu against cpu" in text
    assert "total   0.037   bound 0.001   margin 0.027x" in text


def test_a_state_that_differs_on_the_cpu_fails_even_for_a_tpu_run() -> None:
    # The canonical update promises the state on any hardware: no exception for the CPU.
    status, text = _report(
        _measured("as trained (here)", "tpu", 0), _measured("cpu", "cpu", 37, state_exact=False)
    )
    assert status == 1, text
    assert "DIFFERS" in text


def test_a_tpu_replay_outside_the_bounds_fails() -> None:
    status, _ = _report(_measured("as trained (here)", "tpu", 2.5), _measured("cpu", "cpu", 0))
    assert status == 1


def test_without_the_runs_platform_nothing_is_suggested() -> None:
    status, text = _report(_measured("as trained (here)", "cpu", 37))
    assert status == 0, text
    assert "no environment here computed on a tpu" in text
    assert "bounds with a" not in text


def test_a_jax_run_calibrates_where_torch_is_not_installed(
    make_proof: Callable[..., zkdv.jax.ZKDV],
) -> None:
    proof = make_proof(zkdv.SamplingPolicy(update_check_probability=0.0), gradient_files="always")
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adam(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(4):
        state = step(state, batch)
    proof.close()
    # A TPU host has JAX and no Torch: the worker must not reach for Torch's threads.
    worker = (
        "import sys; sys.modules['torch'] = None\n"
        "from zkdv.calibrate import main\n"
        f"sys.exit(main(__import__('pathlib').Path({str(proof.path)!r}), worker=True, "
        "steps=4, environments=[]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", worker],
        env={**os.environ, THREADS: "3"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["platform_kind"] == "cpu" and row["exact"] for row in rows)
    assert all(row["state_exact"] for row in rows)


def test_a_tpu_run_exported_for_the_tpu_alone_gets_no_cpu_rows_and_says_why() -> None:
    # On the TPU (9th session) such a run's CPU rows each failed with JAX's note about
    # its shortened traceback as the only message: now they are not attempted.
    root = _root("tpu")
    root["env"]["export_platforms"] = ["tpu"]  # type: ignore[index]
    assert default_environments(root) == []
    reason = cpu_unavailable(root)
    assert reason is not None and "exported for tpu only" in reason
    root["env"]["export_platforms"] = ["tpu", "cpu"]  # type: ignore[index]
    assert cpu_unavailable(root) is None
    assert default_environments(root)


def test_a_failed_workers_message_is_the_error_not_jaxs_traceback_note() -> None:
    failed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import jax, jax.numpy as jnp; jax.jit(lambda x: x @ x)(jnp.ones((2, 3)))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "JAX has removed its internal frames" in failed.stderr  # what the TPU run showed
    assert _failure(failed.stderr).startswith("TypeError: dot_general requires contracting")
