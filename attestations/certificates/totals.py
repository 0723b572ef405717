"""How much compute a run used, step by step: running totals of tokens, FLOPs and GPU-hours.

The per-step counts come from the transcript
(:class:`~attestations.certificates.run_facts.RunFacts`); how to count them, from its
root record: how many replicas ran each step's FLOP count (:func:`flop_replicas`), what
counted them (:func:`flop_counter`), and how many accelerators the run held
(:func:`gpu_devices`). :func:`run_totals` sums them after every step, so a declared
limit is checked as an invariant over the run (:func:`first_over` finds the first step
past it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from attestations.certificates.run_facts import RunFacts

__all__ = [
    "RunTotals",
    "first_over",
    "flop_counter",
    "flop_replicas",
    "gpu_devices",
    "run_totals",
]


def flop_replicas(root: Mapping[str, Any]) -> tuple[int, str]:
    """How many copies of the per-step FLOP count ran, and why.

    JAX: the step's jaxpr has the program's logical shapes, so its count is the whole
    step's (``env.flops.method``); older JAX roots recorded XLA's cost analysis, which
    counts one device's partition of an SPMD program, so their step total is that times
    the devices the program's state is sharded over (the mesh in the root's
    ``schema.sharding``; 1 when the state is not sharded). PyTorch: the driver already
    counts every rank's tokens (``tokens = per-rank tokens x world_size``), so its
    per-step FLOPs are the whole step's.
    """
    prover = str(root.get("prover", ""))
    if prover == "whitebox-torch":
        return 1, "per-step FLOPs already cover every rank (tokens x world_size)"
    env = root.get("env") if isinstance(root.get("env"), dict) else {}
    assert isinstance(env, dict)
    stated = env.get("flops")
    if isinstance(stated, dict) and "jaxpr" in str(stated.get("method", "")):
        return 1, "the jaxpr's logical shapes count the whole step, every device"
    schema = root.get("schema") if isinstance(root.get("schema"), dict) else {}
    assert isinstance(schema, dict)
    sharding = schema.get("sharding")
    devices = 1
    if isinstance(sharding, dict):
        for tree in sharding.values():
            for leaf in tree or []:
                if not isinstance(leaf, dict):
                    continue
                if isinstance(leaf.get("mesh"), dict):
                    size = int(np.prod([int(v) for v in leaf["mesh"].values()] or [1]))
                    devices = max(devices, size)
                elif isinstance(leaf.get("devices"), int):
                    devices = max(devices, int(leaf["devices"]))
    if devices == 1:
        return 1, "the program's state is not sharded: one device's cost is the step's"
    return devices, f"per-device XLA cost x {devices} devices of the sharded program"


def flop_counter(root: Mapping[str, Any]) -> str:
    """What produced the per-step FLOP counts, as the root record states it."""
    env = root.get("env") if isinstance(root.get("env"), dict) else {}
    assert isinstance(env, dict)
    stated = env.get("flops")
    if isinstance(stated, dict) and isinstance(stated.get("method"), str):
        return str(stated["method"])
    if root.get("prover") == "whitebox-jax":
        return "XLA cost analysis of the compiled step program"
    return "unstated"


def gpu_devices(root: Mapping[str, Any]) -> int:
    """Accelerators the run held: JAX's global ``device_count``, PyTorch's ``world_size``."""
    env = root.get("env") if isinstance(root.get("env"), dict) else {}
    assert isinstance(env, dict)
    for key in ("device_count", "world_size"):
        value = env.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


def _parameter_count(root: Mapping[str, Any]) -> int:
    schema = root.get("schema") if isinstance(root.get("schema"), dict) else {}
    assert isinstance(schema, dict)
    total = 0
    for leaf in schema.get("params") or []:
        if isinstance(leaf, dict):
            total += int(np.prod([int(d) for d in leaf.get("shape") or []] or [1]))
    return total


@dataclass(frozen=True)
class RunTotals:
    """Running totals after every step, in step order."""

    steps: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    hours: np.ndarray
    flops_details: dict[str, Any]
    hours_details: dict[str, Any]


def run_totals(facts: RunFacts, root: Mapping[str, Any]) -> RunTotals:
    steps = np.asarray(facts.step_index, dtype=np.int64)
    n = int(steps.size)
    tokens = np.cumsum(np.asarray(facts.tokens, dtype=np.int64))
    # FLOPs: per-step counts from the program's cost analysis, times the replicas.
    replicas, why = flop_replicas(root)
    per_step = np.asarray([np.nan if f is None else f for f in facts.flops], dtype=np.float64)
    missing = int(np.isnan(per_step).sum())
    source = "step.flops"
    if missing:
        # No count recorded (an older frontend, a backend without cost analysis): the
        # dense-transformer estimate 6 x parameters x tokens (Kaplan et al. 2020, eq. 2.1).
        estimate = 6.0 * _parameter_count(root) * np.asarray(facts.tokens, dtype=np.float64)
        per_step = np.where(np.isnan(per_step), estimate, per_step)
        source = "6 x parameters x tokens" + (" where step.flops is absent" if missing < n else "")
    flops = np.cumsum(per_step * replicas)
    # GPU-hours: devices x wall time since the first step began (the trainer's clock).
    devices = gpu_devices(root)
    start = np.asarray(facts.start, dtype=np.float64)
    end = np.asarray(facts.end, dtype=np.float64)
    wall = np.zeros(n, np.float64)
    if n and np.isfinite(start).any():
        elapsed = np.nan_to_num(end - float(np.nanmin(start)), nan=0.0).clip(min=0.0)
        wall = np.fmax.accumulate(elapsed)
    return RunTotals(
        steps,
        tokens,
        flops,
        wall * devices / 3600.0,
        {
            "source": source,
            "counter": flop_counter(root),
            "steps_without_count": missing,
            "replicas": replicas,
            "replicas_reason": why,
            "prover": root.get("prover"),
        },
        {
            "devices": devices,
            "wall_seconds": round(float(wall[-1]), 3) if n else 0.0,
            "source": "devices x (last step end - first step start), step.time",
        },
    )


def first_over(cumulative: np.ndarray, limit: Decimal | None) -> int | None:
    """Position of the first running total strictly above ``limit`` (None: never)."""
    if limit is None or cumulative.size == 0:
        return None
    over = np.nonzero(cumulative > float(limit))[0]
    return int(over[0]) if over.size else None
