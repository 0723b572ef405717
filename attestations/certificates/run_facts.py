"""What one pass over a transcript's records yields: the facts every claim is computed from.

:func:`summarize` reads the records once (:class:`RunFacts`: per-step tokens, FLOPs,
times, batch roots and learning rates, the self-checks, snapshots and program changes,
the root and close records); :func:`observed_optimizer` and :func:`declared_regime` read
what the root record states about the optimizer and the regime. Pure functions, tested
without a database (``attestations/certificates/claims.py`` turns the facts into claims).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "RunFacts",
    "declared_regime",
    "hex_of",
    "observed_optimizer",
    "optimizer_family",
    "summarize",
]


@dataclass
class RunFacts:
    """What one pass over the records yields; everything claims are computed from."""

    root: dict[str, Any] | None = None
    step_index: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    flops: list[float | None] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    batch_roots: list[bytes] = field(default_factory=list)
    #: Per step, each optimizer group's committed ``lr`` (``hp``), or None without ``hp``.
    learning_rates: list[tuple[float | None, ...] | None] = field(default_factory=list)
    checked_steps: list[int] = field(default_factory=list)
    failed_checks: list[int] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)
    program_digests: list[str] = field(default_factory=list)
    program_changes: list[tuple[int, str]] = field(default_factory=list)
    close: dict[str, Any] | None = None
    last_post: dict[str, Any] | None = None
    error: str | None = None


def summarize(records: Iterable[Any]) -> RunFacts:
    """Read the facts claims need from transcript records (:class:`zkdv.records.Record`).

    Reading stops, without raising, at the first record the reader cannot decode; the
    facts then cover what came before and ``error`` says why.
    """
    from zkdv.errors import TranscriptError

    facts = RunFacts()
    try:
        for record in records:
            _take(facts, record.data)
    except TranscriptError as error:
        facts.error = f"{error.reason}: {error}"
    return facts


def hex_of(value: Any) -> str | None:
    """A record's bytes as hex (None for anything else)."""
    return value.hex() if isinstance(value, bytes | bytearray) else None


def _learning_rates(hyperparameters: Any) -> tuple[float | None, ...] | None:
    """Each group's ``lr`` from a step's ``hp`` (a group without one: None)."""
    if not isinstance(hyperparameters, list):
        return None
    rates: list[float | None] = []
    for group in hyperparameters:
        value = group.get("lr") if isinstance(group, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            rates.append(float(value) if np.isfinite(value) else None)
        else:
            rates.append(None)
    return tuple(rates)


def _take(facts: RunFacts, data: dict[str, Any]) -> None:
    kind = data.get("t")
    if kind == "step":
        facts.step_index.append(int(data.get("i", len(facts.step_index))))
        tokens = data.get("tokens")
        facts.tokens.append(int(tokens) if isinstance(tokens, int) else 0)
        flops = data.get("flops")
        facts.flops.append(float(flops) if isinstance(flops, int | float) else None)
        times = data.get("time")
        if isinstance(times, list | tuple) and len(times) == 2:
            facts.start.append(float(times[0]))
            facts.end.append(float(times[1]))
        else:
            facts.start.append(float("nan"))
            facts.end.append(float("nan"))
        batch = data.get("batch")
        facts.batch_roots.append(
            batch["root"]
            if isinstance(batch, dict) and isinstance(batch.get("root"), bytes)
            else b""
        )
        facts.learning_rates.append(_learning_rates(data.get("hp")))
        if isinstance(data.get("post"), dict):
            facts.last_post = data["post"]
        program = data.get("program")
        if isinstance(program, dict):  # a phase change the verifier rejects; named here too
            digest = hex_of(program.get("digest")) or ""
            facts.program_digests.append(digest)
            facts.program_changes.append((facts.step_index[-1], digest))
    elif kind == "check":
        step = int(data.get("i", -1))
        (facts.checked_steps if data.get("ok") is True else facts.failed_checks).append(step)
    elif kind == "snap":
        facts.snapshot_steps.append(int(data.get("i", -1)))
    elif kind == "close":
        facts.close = data
    elif kind == "root" and facts.root is None:
        facts.root = data
        program = data.get("program")
        if isinstance(program, dict):
            facts.program_digests.append(hex_of(program.get("digest")) or "")


# --- What the root record states ------------------------------------------------------

_OPTIMIZER_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Longest names first, so "adamw" is not read as "adam".
    ("adamw", ("adamw",)),
    ("adafactor", ("adafactor",)),
    ("adagrad", ("adagrad",)),
    ("rmsprop", ("rmsprop",)),
    ("lamb", ("lamb",)),
    ("lion", ("lion",)),
    ("adam", ("adam",)),
    ("sgd", ("sgd", "momentum", "nesterov")),
)


def optimizer_family(text: str) -> str | None:
    """The optimizer family a free-text name mentions (``"optax.adamw(3e-4)"``: ``adamw``)."""
    lowered = text.lower()
    for family, words in _OPTIMIZER_FAMILIES:
        if any(re.search(rf"(?<![a-z]){word}(?![a-z])", lowered) for word in words):
            return family
    return None


def observed_optimizer(root: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer as the transcript states it.

    PyTorch runs record the optimizer contract and every parameter group's options in
    the root's ``env.optimizer``. JAX runs compile the optimizer into the attested program,
    so the transcript states it only through the optimizer-state leaves (Adam keeps ``mu``
    and ``nu``, momentum SGD a ``trace``), from which the family is inferred.
    """
    env = root.get("env") if isinstance(root.get("env"), dict) else {}
    assert isinstance(env, dict)
    declared = env.get("optimizer")
    if isinstance(declared, dict):
        contract = str(declared.get("contract", ""))
        return {
            "source": "root.env.optimizer",
            "family": optimizer_family(contract),
            "contract": contract,
            "hyperparameters": declared.get("groups"),
        }
    schema = root.get("schema") if isinstance(root.get("schema"), dict) else {}
    assert isinstance(schema, dict)
    paths = [
        str(leaf.get("path", ""))
        for leaf in schema.get("opt_state") or []
        if isinstance(leaf, dict)
    ]
    names = {part for path in paths for part in re.split(r"[^a-z_]+", path.lower()) if part}
    family: str | None = None
    if {"mu", "nu"} <= names or {"exp_avg", "exp_avg_sq"} <= names:
        family = "adam"
    elif "trace" in names or "momentum_buffer" in names or any(n.startswith("mu_") for n in names):
        family = "sgd"
    return {
        "source": "root.schema.opt_state",
        "family": family,
        "contract": None,
        "hyperparameters": None,
        "state_leaves": paths[:32],
    }


def declared_regime(root: Mapping[str, Any]) -> str | None:
    """The regime the trainer declared in the root record (``experiment.regime``), if any."""
    experiment = root.get("experiment")
    if isinstance(experiment, dict) and isinstance(experiment.get("regime"), str):
        return str(experiment["regime"])
    env = root.get("env")
    if isinstance(env, dict) and isinstance(env.get("regime"), str):
        return str(env["regime"])
    return None
