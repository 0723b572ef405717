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

The facts come from one pass over the records
(:func:`attestations.certificates.run_facts.summarize`) and the running totals from
``attestations/certificates/totals.py``; :func:`evaluate` is a pure function of the
facts and the declared limits (tested without a database); :func:`compute_claims` reads
a proof's stored transcript and caches its result under the transcript's content
address, so a page view does not re-read a large transcript. See ``docs/claims.md``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np

from attestations.certificates.run_facts import (
    RunFacts,
    declared_regime,
    hex_of,
    observed_optimizer,
    optimizer_family,
    summarize,
)
from attestations.certificates.totals import RunTotals, first_over, run_totals
from dvbench.attest import Claim, Evidence
from zkdv.config import DEFAULT_TOKEN_UNIT, FLOPS_COUNTED, FLOPS_ESTIMATED, TOKEN_UNITS

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
    "Series",
    "Violation",
    "compute_claims",
    "evaluate",
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
    token_unit: str = DEFAULT_TOKEN_UNIT

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
            token_unit=getattr(spec, "token_unit", None) or DEFAULT_TOKEN_UNIT,
        )


@dataclass(frozen=True)
class ReplayFacts:
    """What the platform's replays of challenged steps established.

    Attributes:
        passed: challenged steps whose replay matched the committed state.
        failed: challenged steps whose replay did not (or expired unanswered).
        unreplayed: challenged steps no worker of the run's platform kind replayed.
    """

    passed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    unreplayed: tuple[int, ...] = ()

    @property
    def verified(self) -> bool:
        """Replays passed, none failed and none was left without a replay: replay-level
        evidence may be claimed."""
        return bool(self.passed) and not self.failed and not self.unreplayed

    def fingerprint(self) -> str:
        text = f"p{','.join(map(str, self.passed))}f{','.join(map(str, self.failed))}"
        return text + (f"u{','.join(map(str, self.unreplayed))}" if self.unreplayed else "")


# --- Claims -----------------------------------------------------------------------------


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


def _over(
    limit: str, declared: Decimal | None, totals: np.ndarray, steps: np.ndarray, what: str
) -> tuple[Violation, ...]:
    """The violation of a running-total limit at the first step over it, if any."""
    at = first_over(totals, declared)
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
    facts: RunFacts, totals: RunTotals, limits: Limits, total: int, replayed: Evidence
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
    unit = unit if unit in TOKEN_UNITS else None
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


def flops_recounted(root: Mapping[str, Any]) -> bool:
    """Whether every replay recounts the step records' FLOPs (``flops_mismatch``).

    A Torch run's ``torch.export`` program is counted again by Torch's FLOP counter, and
    a count the SDK estimated (``6 x parameters x tokens``) is recomputed; an AOT
    Inductor program (native code) and a JAX program are not counted by the replay.
    """
    if root.get("prover") != "whitebox-torch":
        return False
    env = root.get("env") if isinstance(root.get("env"), Mapping) else {}
    assert isinstance(env, Mapping)
    stated = env.get("flops") if isinstance(env.get("flops"), Mapping) else {}
    program = env.get("program") if isinstance(env.get("program"), Mapping) else {}
    assert isinstance(stated, Mapping) and isinstance(program, Mapping)
    method = stated.get("method")
    if method == FLOPS_ESTIMATED:
        return True
    return method == FLOPS_COUNTED and program.get("kind") == "torch.export"


def _compute_parts(
    facts: RunFacts, totals: RunTotals, limits: Limits, replayed: Evidence
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
            Claim(
                "flops",
                round(float(last(totals.flops))),
                replayed if flops_recounted(facts.root or {}) else committed,
                "FLOP",
            ),
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
    observed = observed_optimizer(root)
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
    regime = declared_regime(root)
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
    initial = (facts.root or {}).get("initial")
    details = {
        "source": "close.final.p" if root_bytes is not None else None,
        "last_step_post": hex_of(facts.last_post.get("p")) if facts.last_post else None,
        # Where the run started: a lineage's link to the run it fine-tunes
        # (certificates/subjects.py, lineage_claim).
        "initial_parameter_root": hex_of(initial.get("p")) if isinstance(initial, dict) else None,
    }
    return _Part(Claim("final_parameter_root", hex_of(root_bytes), Evidence.COMMITTED), details)


def _series(facts: RunFacts, totals: RunTotals, violations: Sequence[Violation]) -> Series:
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
    totals = run_totals(facts, root)
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
    unreplayed: list[int] = []
    rows = Challenge.objects.filter(proof=proof).order_by().values_list("step", "through", "status")
    for step, through, status in rows:
        span = range(step, (through if through is not None else step) + 1)
        if status == ChallengeStatus.PASSED:
            passed.extend(span)
        elif status in (ChallengeStatus.FAILED, ChallengeStatus.EXPIRED):
            failed.extend(span)
        elif status == ChallengeStatus.UNREPLAYED:
            unreplayed.extend(span)
    return ReplayFacts(
        tuple(sorted(set(passed))), tuple(sorted(set(failed))), tuple(sorted(set(unreplayed)))
    )


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


#: The certificate's claim of the run's compute added to its parent runs'
#: (``certificates/subjects.py``, ``lineage_claim``).
CLAIM_LINEAGE = "lineage"


def lineage_total(claims: Sequence[Claim]) -> Decimal | None:
    """The ``lineage`` claim's total as a whole Decimal, the column regulators search on
    (None without the claim, or when the total is undetermined)."""
    for claim in claims:
        if claim.name == CLAIM_LINEAGE and isinstance(claim.value, Mapping):
            value = claim.value.get("flops")
            if isinstance(value, int | float) and not isinstance(value, bool):
                return Decimal(int(value))
    return None
