"""Policy claims of a proof, each with its evidence level, and the declared limits as invariants.

A claim is what the platform says about a training run: how many steps, tokens and FLOPs,
how many GPU-hours, which optimizer, which regime, one program throughout, which data and
which final parameters. Each carries the strongest evidence that backs it
(:class:`dvbench.attest.Evidence`):

* ``verified_by_replay``: the platform replayed challenged steps with the committed
  program and matched the committed state, which exercises the claim (optimizer and its
  hyperparameters, the program digest);
* ``committed_in_transcript``: bound by the transcript's hash chain, which the verifier
  checked, but not recomputed (steps, per-step tokens and FLOPs, batch roots, final roots);
* ``reported_by_trainer``: the trainer's word only (wall-clock times, hence GPU-hours;
  a declared regime).

The experiment's declared limits are invariants over the run, not only over its end: the
cumulative FLOPs, tokens and GPU-hours are summed step by step, and a violation names the
first step at which the running total passed the limit (the step a policy engine would
have stopped training at).

:func:`summarize` and :func:`evaluate` are pure functions of the transcript's records and
the declared limits (tested without a database); :func:`compute_claims` reads a proof's
stored transcript and caches its result under the transcript's content address, so a page
view does not re-read a large transcript. See ``docs/claims.md``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np

from dvbench.attest import Claim, Evidence

if TYPE_CHECKING:
    from attestations.experiments.models import ExperimentSpec
    from attestations.proofs.models import Proof

log = logging.getLogger(__name__)

__all__ = [
    "CLAIMS_SCHEMA",
    "CLAIM_NAMES",
    "ClaimSet",
    "Limits",
    "ReplayFacts",
    "RunFacts",
    "Series",
    "Violation",
    "compute_claims",
    "evaluate",
    "summarize",
    "whole_claim",
]

#: The schema tag of :meth:`ClaimSet.to_dict`; bump it when the document changes.
CLAIMS_SCHEMA = "dvbench.claims/v1"
#: Every claim, in the order reports list them.
CLAIM_NAMES = (
    "steps",
    "tokens",
    "flops",
    "gpu_hours",
    "optimizer",
    "regime",
    "program_digest",
    "dataset_commitment",
    "final_parameter_root",
)
#: The dataset commitment the SDK registers when a trainer declares none.
UNDECLARED_DATASET = "0" * 64
#: Points kept in the cumulative series a chart draws (a long run is downsampled).
SERIES_POINTS = 400
_CACHE_PREFIX = "dvbench:claims:v3"
_CACHE_SECONDS = 7 * 24 * 3600


# --- The outcome ------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    """A declared limit the run broke.

    Attributes:
        limit: the spec field, e.g. ``"max_flops"`` or ``"allowed_regimes"``.
        declared: the declared value (a number, or a list of regimes).
        actual: the running total at ``step`` (or the observed value).
        step: the first step at which the invariant failed; None when the limit is not a
            running total (a regime, an optimizer).
        message: one sentence for people.
    """

    limit: str
    declared: Any
    actual: Any
    step: int | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "declared": self.declared,
            "actual": self.actual,
            "step": self.step,
            "message": self.message,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Violation:
        return cls(
            str(data["limit"]), data["declared"], data["actual"], data["step"], str(data["message"])
        )


@dataclass(frozen=True)
class Series:
    """Cumulative totals after selected steps, for charts (at most :data:`SERIES_POINTS`).

    The first and last steps and every violation step are always kept, so a chart shows
    exactly where a limit was crossed.
    """

    steps: tuple[int, ...] = ()
    flops: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()
    gpu_hours: tuple[float, ...] = ()
    #: Per kept step, each optimizer group's learning rate as the step record commits it
    #: (``hp``: what the run's schedulers set); empty for runs that commit none (JAX).
    learning_rate: tuple[tuple[float | None, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "flops": list(self.flops),
            "tokens": list(self.tokens),
            "gpu_hours": list(self.gpu_hours),
            "learning_rate": [list(rates) for rates in self.learning_rate],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Series:
        return cls(
            tuple(int(x) for x in data["steps"]),
            tuple(float(x) for x in data["flops"]),
            tuple(int(x) for x in data["tokens"]),
            tuple(float(x) for x in data["gpu_hours"]),
            tuple(
                tuple(None if x is None else float(x) for x in rates)
                for rates in data.get("learning_rate", ())
            ),
        )


@dataclass(frozen=True)
class ClaimSet:
    """The claims of one proof and the declared limits it broke.

    Attributes:
        claims: one :class:`~dvbench.attest.Claim` per name in :data:`CLAIM_NAMES`.
        violations: limits broken, in the order of :data:`CLAIM_NAMES`.
        details: per claim, how it was obtained (sources, replica counts, comparisons).
        series: cumulative totals for the compute chart.
        timeline: self-checked and snapshot steps, and the run's start and end times.
        transcript_error: why the transcript could not be read to its end (claims then
            cover the records before the error), else None.
    """

    claims: tuple[Claim, ...]
    violations: list[Violation]
    details: dict[str, Any] = field(default_factory=dict)
    series: Series = field(default_factory=Series)
    timeline: dict[str, Any] = field(default_factory=dict)
    transcript_error: str | None = None

    @property
    def ok(self) -> bool:
        """No declared limit was broken and the transcript was read to its end."""
        return not self.violations and self.transcript_error is None

    def claim(self, name: str) -> Claim | None:
        return next((claim for claim in self.claims if claim.name == name), None)

    def value(self, name: str) -> Any:
        claim = self.claim(name)
        return None if claim is None else claim.value

    def to_dict(self) -> dict[str, Any]:
        """The JSON document the API returns and the cache stores."""
        return {
            "schema": CLAIMS_SCHEMA,
            "ok": self.ok,
            "claims": [claim.to_dict() for claim in self.claims],
            "violations": [violation.to_dict() for violation in self.violations],
            "details": self.details,
            "series": self.series.to_dict(),
            "timeline": self.timeline,
            "transcript_error": self.transcript_error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClaimSet:
        return cls(
            claims=tuple(
                Claim.from_dict(claim, f"claims[{index}]")
                for index, claim in enumerate(data["claims"])
            ),
            violations=[Violation.from_dict(v) for v in data["violations"]],
            details=dict(data["details"]),
            series=Series.from_dict(data["series"]),
            timeline=dict(data["timeline"]),
            transcript_error=data.get("transcript_error"),
        )


# --- Facts read from the transcript -----------------------------------------------------


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


def _hex(value: Any) -> str | None:
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
            digest = _hex(program.get("digest")) or ""
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
            facts.program_digests.append(_hex(program.get("digest")) or "")


# --- Declared limits and replay outcome -------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The declared spec a run is held to.

    Read from :class:`~attestations.experiments.models.ExperimentSpec`.
    """

    max_flops: Decimal | None = None
    max_tokens: Decimal | None = None
    max_gpu_hours: Decimal | None = None
    allowed_regimes: tuple[str, ...] = ()
    optimizer: str = ""
    dataset_commitment: str = ""
    #: What ``max_tokens`` counts (``examples`` or ``tokens``, zkdv's ``token_unit``).
    token_unit: str = "examples"  # noqa: S105 - a unit, not a secret

    @classmethod
    def of(cls, spec: ExperimentSpec) -> Limits:
        def decimal(value: Any) -> Decimal | None:
            return None if value is None else Decimal(value)

        return cls(
            max_flops=decimal(spec.max_flops),
            max_tokens=decimal(spec.max_tokens),
            max_gpu_hours=decimal(spec.max_gpu_hours),
            allowed_regimes=tuple(sorted(spec.allowed_regimes or [])),
            optimizer=spec.optimizer,
            dataset_commitment=spec.dataset_commitment,
            token_unit=getattr(spec, "token_unit", "examples") or "examples",
        )


@dataclass(frozen=True)
class ReplayFacts:
    """What the platform's replays of challenged steps established.

    Attributes:
        passed: challenged steps whose replay matched the committed state.
        failed: challenged steps whose replay did not (or expired unanswered).
    """

    passed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    @property
    def verified(self) -> bool:
        """Replays passed and none failed: replay-level evidence may be claimed."""
        return bool(self.passed) and not self.failed

    def fingerprint(self) -> str:
        return f"p{','.join(map(str, self.passed))}f{','.join(map(str, self.failed))}"


# --- Claims -----------------------------------------------------------------------------

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


def _observed_optimizer(root: Mapping[str, Any]) -> dict[str, Any]:
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


def _regime(root: Mapping[str, Any]) -> str | None:
    """The regime the trainer declared in the root record (``experiment.regime``), if any."""
    experiment = root.get("experiment")
    if isinstance(experiment, dict) and isinstance(experiment.get("regime"), str):
        return str(experiment["regime"])
    env = root.get("env")
    if isinstance(env, dict) and isinstance(env.get("regime"), str):
        return str(env["regime"])
    return None


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


def _first_over(cumulative: np.ndarray, limit: Decimal | None) -> int | None:
    """Position of the first running total strictly above ``limit`` (None: never)."""
    if limit is None or cumulative.size == 0:
        return None
    over = np.nonzero(cumulative > float(limit))[0]
    return int(over[0]) if over.size else None


def _limit_number(value: Decimal) -> int | float:
    return int(value) if value == value.to_integral_value() else float(value)


def _downsample(count: int, keep: Sequence[int]) -> np.ndarray:
    if count <= SERIES_POINTS:
        return np.arange(count)
    picks = np.unique(np.linspace(0, count - 1, SERIES_POINTS).round().astype(np.int64))
    extra = np.asarray([k for k in keep if 0 <= k < count], dtype=np.int64)
    return np.unique(np.concatenate([picks, extra]))


@dataclass(frozen=True)
class _Part:
    """One claim, how it was obtained, and the limits it broke."""

    claim: Claim
    details: dict[str, Any]
    violations: tuple[Violation, ...] = ()


@dataclass(frozen=True)
class _Totals:
    """Running totals after every step, in step order."""

    steps: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    hours: np.ndarray
    flops_details: dict[str, Any]
    hours_details: dict[str, Any]


def _totals(facts: RunFacts, root: Mapping[str, Any]) -> _Totals:
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
    return _Totals(
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


def _over(
    limit: str, declared: Decimal | None, totals: np.ndarray, steps: np.ndarray, what: str
) -> tuple[Violation, ...]:
    """The violation of a running-total limit at the first step over it, if any."""
    at = _first_over(totals, declared)
    if at is None or declared is None:
        return ()
    actual = totals[at].item()
    actual = round(actual) if limit == "max_flops" else actual
    actual = round(actual, 9) if isinstance(actual, float) else actual
    step = int(steps[at])
    return (
        Violation(
            limit,
            _limit_number(declared),
            actual,
            step,
            f"cumulative {what} reached {actual:.6g} at step {step}, over the declared "
            f"maximum of {float(declared):.6g}",
        ),
    )


#: The token claim's unit per ``config.token_unit`` of the root record; a root without it
#: (transcripts from before the unit was recorded) counted the committed batch's
#: elements.
TOKEN_CLAIM_UNITS = {"examples": "example", "tokens": "token", None: "batch element"}


def _tokens_part(
    facts: RunFacts, totals: _Totals, limits: Limits, total: int, replayed: Evidence
) -> _Part:
    """The token claim in the run's unit, held to ``max_tokens`` in the spec's unit.

    Every replay recounts every step record's ``tokens`` against the batch the committed
    program takes and fails on a mismatch (``tokens_mismatch``, docs/provers.md), so after
    passing replays the count is verified by replay, not only committed.

    A run that counts in another unit than the spec declares cannot be held to its
    ``max_tokens``: with a declared maximum, that is a violation in itself (a lab must
    not pick the unit that passes after training).
    """
    config = (facts.root or {}).get("config")
    unit = config.get("token_unit") if isinstance(config, dict) else None
    unit = unit if unit in ("examples", "tokens") else None
    details = {
        "source": "step.tokens",
        "token_unit": unit,
        "declared_token_unit": limits.token_unit,
        "limit": _opt(limits.max_tokens),
    }
    violations = _over("max_tokens", limits.max_tokens, totals.tokens, totals.steps, "tokens")
    if limits.max_tokens is not None and unit != limits.token_unit:
        counted = "batch elements (no unit recorded)" if unit is None else unit
        violations = (
            Violation(
                "token_unit",
                limits.token_unit,
                unit,
                None,
                f"max_tokens is declared in {limits.token_unit}, and the run counts "
                f"{counted}: its token count cannot be held to the declared maximum",
            ),
            *violations,
        )
    return _Part(Claim("tokens", total, replayed, TOKEN_CLAIM_UNITS[unit]), details, violations)


def _compute_parts(
    facts: RunFacts, totals: _Totals, limits: Limits, replayed: Evidence
) -> list[_Part]:
    n = int(totals.steps.size)
    last = (lambda a: a[-1].item()) if n else (lambda a: 0)
    committed = Evidence.COMMITTED
    return [
        _Part(
            Claim("steps", n, committed, "step"),
            {
                "close_record_steps": facts.close.get("steps") if facts.close else None,
                "sampled_checks": len(facts.checked_steps),
                "failed_checks": len(facts.failed_checks),
            },
        ),
        _tokens_part(facts, totals, limits, int(last(totals.tokens)), replayed),
        _Part(
            Claim("flops", round(float(last(totals.flops))), committed, "FLOP"),
            {**totals.flops_details, "limit": _opt(limits.max_flops)},
            _over("max_flops", limits.max_flops, totals.flops, totals.steps, "FLOPs"),
        ),
        _Part(
            Claim("gpu_hours", round(float(last(totals.hours)), 6), Evidence.REPORTED, "GPU-hour"),
            {**totals.hours_details, "limit": _opt(limits.max_gpu_hours)},
            _over("max_gpu_hours", limits.max_gpu_hours, totals.hours, totals.steps, "GPU-hours"),
        ),
    ]


def _optimizer_part(root: Mapping[str, Any], limits: Limits, replayed: Evidence) -> _Part:
    observed = _observed_optimizer(root)
    declared_family = optimizer_family(limits.optimizer)
    matches: bool | None = None
    if declared_family is not None and observed["family"] is not None:
        # Adam and AdamW keep the same state leaves: from the state alone they are one.
        inferred = observed["source"] == "root.schema.opt_state"
        same = {declared_family, observed["family"]} == {"adam", "adamw"}
        matches = declared_family == observed["family"] or (inferred and same)
    # A replay runs the committed optimizer transition with the recorded options, so a
    # passing replay backs the options PyTorch records; JAX compiles them into the program.
    evidence = replayed if observed["source"] == "root.env.optimizer" else Evidence.COMMITTED
    if observed["family"] is None:
        evidence = Evidence.REPORTED
    violations: tuple[Violation, ...] = ()
    if matches is False:
        violations = (
            Violation(
                "optimizer",
                limits.optimizer,
                observed["contract"] or observed["family"],
                None,
                f"the spec declares optimizer family {declared_family}; the transcript shows "
                f"{observed['family']} ({observed['source']})",
            ),
        )
    value = {
        "family": observed["family"],
        "contract": observed["contract"],
        "hyperparameters": _json_safe(observed["hyperparameters"]),
        "declared": limits.optimizer,
        "matches_declared": matches,
    }
    details = {k: v for k, v in observed.items() if k in ("source", "state_leaves")}
    return _Part(Claim("optimizer", value, evidence), details, violations)


def _regime_part(facts: RunFacts, root: Mapping[str, Any], limits: Limits) -> _Part:
    regime = _regime(root)
    allowed = list(limits.allowed_regimes)
    violations: tuple[Violation, ...] = ()
    if regime is not None and allowed and regime not in allowed:
        violations = (
            Violation(
                "allowed_regimes",
                allowed,
                regime,
                None,
                f"the run declares regime {regime!r}; the spec allows {', '.join(allowed)}",
            ),
        )
    phases = max(1, len(set(facts.program_digests)))
    return _Part(
        Claim(
            "regime",
            {"declared_by_trainer": regime, "allowed": allowed, "program_phases": phases},
            Evidence.REPORTED,
        ),
        {
            "note": "the transcript binds one program for the whole run; the regime is the "
            "trainer's declaration (root.experiment.regime) when present",
        },
        violations,
    )


def _program_part(facts: RunFacts, root: Mapping[str, Any], replayed: Evidence) -> _Part:
    digests = list(dict.fromkeys(facts.program_digests))
    program = root.get("program") if isinstance(root.get("program"), dict) else None
    violations: tuple[Violation, ...] = ()
    if len(digests) > 1:
        changed = next((i for i, d in facts.program_changes if d != digests[0]), None)
        violations = (
            Violation(
                "program",
                digests[0],
                digests,
                changed,
                f"the program changed at step {changed}: a hidden phase change "
                f"({len(digests)} distinct program digests)",
            ),
        )
    value = digests[0] if len(digests) == 1 else (digests or None)
    # Replays execute the committed artifact itself, so passing replays back its digest.
    evidence = replayed if program is not None else Evidence.COMMITTED
    details = {
        "kind": program.get("kind") if program else None,
        "bytes": program.get("bytes") if program else None,
        "distinct_digests": len(digests),
        "single_program": len(digests) <= 1,
    }
    return _Part(Claim("program_digest", value, evidence), details, violations)


def _dataset_part(facts: RunFacts, limits: Limits) -> _Part:
    sequence = hashlib.sha256(b"".join(facts.batch_roots)).hexdigest()
    declared = limits.dataset_commitment.lower()
    matches = declared == sequence
    value = {
        "declared": None if declared in ("", UNDECLARED_DATASET) else declared,
        "batch_sequence_digest": sequence,
        "matches_declared": matches,
    }
    details = {
        "batch_sequence_digest": "SHA-256 of the concatenated per-step batch roots, in step order",
        "batches": len(facts.batch_roots),
    }
    evidence = Evidence.COMMITTED if matches else Evidence.REPORTED
    return _Part(Claim("dataset_commitment", value, evidence), details)


def _final_root_part(facts: RunFacts) -> _Part:
    final = facts.close.get("final") if facts.close else None
    root_bytes = final.get("p") if isinstance(final, dict) else None
    details = {
        "source": "close.final.p" if root_bytes is not None else None,
        "last_step_post": _hex(facts.last_post.get("p")) if facts.last_post else None,
    }
    return _Part(Claim("final_parameter_root", _hex(root_bytes), Evidence.COMMITTED), details)


def _series(facts: RunFacts, totals: _Totals, violations: Sequence[Violation]) -> Series:
    steps = totals.steps
    keep = [
        int(np.nonzero(steps == v.step)[0][0])
        for v in violations
        if v.step is not None and bool((steps == v.step).any())
    ]
    rates = facts.learning_rates
    picks = _downsample(int(steps.size), keep)
    groups = max((len(rate) for rate in rates if rate is not None), default=0)
    return Series(
        tuple(int(steps[i]) for i in picks),
        tuple(float(totals.flops[i]) for i in picks),
        tuple(int(totals.tokens[i]) for i in picks),
        tuple(round(float(totals.hours[i]), 9) for i in picks),
        tuple(rates[i] or (None,) * groups for i in picks) if groups else (),
    )


def _timeline(facts: RunFacts, replay: ReplayFacts) -> dict[str, Any]:
    start = [t for t in facts.start if np.isfinite(t)]
    end = [t for t in facts.end if np.isfinite(t)]
    return {
        "checked_steps": facts.checked_steps[:5000],
        "failed_checks": facts.failed_checks[:5000],
        "snapshot_steps": facts.snapshot_steps[:5000],
        "started": min(start) if start else None,
        "ended": max(end) if end else None,
        "replay_passed": list(replay.passed),
        "replay_failed": list(replay.failed),
    }


def evaluate(facts: RunFacts, limits: Limits, replay: ReplayFacts | None = None) -> ClaimSet:
    """Compute every claim and check the declared limits as running invariants.

    Args:
        facts: from :func:`summarize`.
        limits: the declared spec.
        replay: what the platform's replays established (None: no replay yet).

    Returns:
        The claims in :data:`CLAIM_NAMES` order and the violations.
    """
    replay = replay or ReplayFacts()
    root = facts.root or {}
    replayed = Evidence.REPLAYED if replay.verified else Evidence.COMMITTED
    totals = _totals(facts, root)
    parts = [
        *_compute_parts(facts, totals, limits, replayed),
        _optimizer_part(root, limits, replayed),
        _regime_part(facts, root, limits),
        _program_part(facts, root, replayed),
        _dataset_part(facts, limits),
        _final_root_part(facts),
    ]
    violations = [violation for part in parts for violation in part.violations]
    return ClaimSet(
        claims=tuple(part.claim for part in parts),
        violations=violations,
        details={part.claim.name: part.details for part in parts},
        series=_series(facts, totals, violations),
        timeline=_timeline(facts, replay),
        transcript_error=facts.error,
    )


def _opt(value: Decimal | None) -> int | float | None:
    return None if value is None else _limit_number(value)


def _json_safe(value: Any) -> Any:
    """Hyperparameters as plain JSON (tuples become lists; odd values become strings)."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    return str(value)


# --- A proof's claims -------------------------------------------------------------------


def replay_facts(proof: Proof) -> ReplayFacts:
    """The outcome of the platform's challenges of ``proof`` (its Challenge rows)."""
    from attestations.challenges.models import Challenge, ChallengeStatus

    passed: list[int] = []
    failed: list[int] = []
    rows = Challenge.objects.filter(proof=proof).order_by().values_list("step", "through", "status")
    for step, through, status in rows:
        span = range(step, (through if through is not None else step) + 1)
        if status == ChallengeStatus.PASSED:
            passed.extend(span)
        elif status in (ChallengeStatus.FAILED, ChallengeStatus.EXPIRED):
            failed.extend(span)
    return ReplayFacts(tuple(sorted(set(passed))), tuple(sorted(set(failed))))


def cache_key(proof: Proof, replay: ReplayFacts) -> str:
    """Where a proof's claims are cached: the transcript's content address, the spec digest
    and the replay outcome, so any change to what they depend on is a new key."""
    fingerprint = hashlib.sha256(replay.fingerprint().encode()).hexdigest()[:16]
    return f"{_CACHE_PREFIX}:{proof.transcript.sha256}:{proof.spec.digest}:{fingerprint}"


def compute_claims(proof: Proof, *, use_cache: bool = True) -> ClaimSet:
    """The claims of ``proof`` against its spec, read from its stored transcript.

    Cached (Django's cache) under :func:`cache_key`; a stored transcript never changes,
    so a cached result is only ever replaced when the spec or the replays change.

    Args:
        proof: any proof whose transcript blob is stored (final or not).
        use_cache: False to recompute and refresh the cache.

    Returns:
        The :class:`ClaimSet`. A transcript that cannot be read to its end yields claims
        over the records before the fault, with ``transcript_error`` set.
    """
    from django.core.cache import cache
    from django.core.files.storage import default_storage

    from zkdv.records import iter_records

    replay = replay_facts(proof)
    key = cache_key(proof, replay)
    if use_cache:
        cached = cache.get(key)
        if isinstance(cached, dict):
            try:
                return ClaimSet.from_dict(cached)
            except Exception:  # noqa: BLE001 - a stale or foreign entry is recomputed
                log.warning("ignoring an unreadable cached claim set %s", key)
    with default_storage.open(proof.transcript.storage_name, "rb") as handle:
        facts = summarize(iter_records(handle))
    result = evaluate(facts, Limits.of(proof.spec), replay)
    cache.set(key, result.to_dict(), _CACHE_SECONDS)
    return result


def whole_claim(claims: Sequence[Claim], name: str) -> Decimal | None:
    """The claim ``name``'s number as a whole Decimal (a searchable column), if numeric.

    A certificate row repeats its signed ``flops`` and ``tokens`` this way: issuance
    writes them, and the log's re-verification checks them against the signed claims.
    """
    for claim in claims:
        value = claim.value
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if claim.name == name and numeric:
            return Decimal(int(value))
    return None
