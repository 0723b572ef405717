"""What a certificate binds and states beyond the run's claims: files, model, thresholds, odds.

Kept apart from issuance (``attestations/certificates/issuance.py``: what is signed, by
which key, into which log entry) so that each addition to the certificate is one function
here, called once at issuance:

* :func:`file_subjects`: ``sha256`` subjects for tools that match files by SHA-256: the
  transcript file as uploaded (``records.cborl``), and the final model's files when the
  trainer attached them (:func:`check_model`), with the OpenSSF model-signing manifest
  (``model_signing/<model name>``);
* :func:`model_claim`: ``final_model``: which weights, that they commit to the
  transcript's final parameter root, and their model_signing signature;
* :func:`lineage_claim`: ``lineage``: the run's compute added to that of the runs its
  model descends from: the parent its spec declares (``parent_transcript``), or the
  certified run whose final parameters are exactly this run's initial ones;
* :func:`threshold_claim`: ``regulatory_thresholds``: whether the compute each configured
  threshold counts (``DVBENCH_REGULATORY_THRESHOLDS``; by default the EU AI Act's 10^23
  and 10^25 FLOP of the run, and SB 53's 10^26 of the lineage) stays at or below it;
* :func:`guarantee_claim`: ``detection_guarantee``: what the platform's challenges
  guarantee: ``m`` uniformly drawn steps detect a run with a fraction ``f`` of forged
  steps with probability at least ``1 - (1 - f)^m``, replayed values compared within the
  stated tolerance.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import models

from attestations.certificates import platforms
from attestations.certificates.claims import CLAIM_LINEAGE, _limit_number
from attestations.certificates.models import Certificate, CertificateResult
from attestations.challenges.models import Challenge, ChallengeStatus
from attestations.proofs.model_files import check_weights, final_parameters, model_names
from attestations.proofs.models import Proof, ProofArtifact
from dvbench import (
    MODEL_DIR,
    PUBLIC_KEY_FILE,
    SIGNATURE_FILE,
)
from dvbench.attest import (
    DIGEST_SHA256,
    SUBJECT_MODEL_SIGNING_PREFIX,
    SUBJECT_TRANSCRIPT_FILE,
    AttestationError,
    Claim,
    Evidence,
    Subject,
    model_signature_subject,
)
from provers.drift import RUN_P, WINDOW_P

log = logging.getLogger(__name__)

__all__ = [
    "CLAIM_DETECTION",
    "CLAIM_LINEAGE",
    "CLAIM_MODEL",
    "CLAIM_THRESHOLDS",
    "MEASURED_UNDETECTED",
    "ModelCheck",
    "Threshold",
    "check_model",
    "file_subjects",
    "guarantee_claim",
    "lineage_claim",
    "model_claim",
    "model_names",
    "threshold_claim",
    "thresholds",
    "weights_sha256",
]

CLAIM_MODEL: Final = "final_model"
CLAIM_THRESHOLDS: Final = "regulatory_thresholds"
CLAIM_DETECTION: Final = "detection_guarantee"
#: Evidence levels, strongest first: the weakest of several is the last of them here.
_EVIDENCE_ORDER: Final = tuple(Evidence)


# --- the final model ------------------------------------------------------------------


@dataclass
class ModelCheck:
    """What the platform found checking a proof's attached model.

    Attributes:
        files: ``[{name, sha256, size}]`` of the safetensors files that matched.
        problem: why the model is not bound (None when it is, or when there is none).
        manifest: ``(model name, manifest sha256)`` of a verified ``model.sig``.
        public_key_sha256: SHA-256 of the PEM key that verified it.
        signature_problem: why ``model.sig`` is not bound (None when it is or is absent).
    """

    files: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    manifest: tuple[str, str] | None = None
    public_key_sha256: str | None = None
    signature_problem: str | None = None

    @property
    def present(self) -> bool:
        return bool(self.files) or self.problem is not None


def check_signature(artifacts: Mapping[str, tuple[str, int]], model: str) -> tuple[str, str, str]:
    """Verify ``model/model.sig`` over ``model`` with ``model/model-signing.pub`` (model_signing).

    Args:
        artifacts: attached name -> (storage name, size).
        model: the name of the safetensors file it signs.

    Returns:
        The model name and manifest SHA-256 the signature signs, and the key's SHA-256.

    Raises:
        ValueError: the signature does not verify, or a file is missing.
    """
    import hashlib

    signature, public = f"{MODEL_DIR}/{SIGNATURE_FILE}", f"{MODEL_DIR}/{PUBLIC_KEY_FILE}"
    if public not in artifacts:
        raise ValueError(f"{signature} has no {public} to verify it with")
    try:
        import model_signing
    except ImportError as error:  # pragma: no cover - a platform dependency
        raise ValueError(f"the platform cannot verify model signatures: {error}") from None
    with tempfile.TemporaryDirectory(prefix="dvbench-model-") as scratch:
        folder = Path(scratch)
        for name in (model, signature, public):
            with (
                default_storage.open(artifacts[name][0], "rb") as source,
                open(folder / Path(name).name, "wb") as target,
            ):
                shutil.copyfileobj(source, target, 1 << 20)
        try:
            model_signing.verifying.Config().use_elliptic_key_verifier(  # type: ignore[no-untyped-call]
                public_key=folder / PUBLIC_KEY_FILE
            ).verify(folder / Path(model).name, folder / SIGNATURE_FILE)
        except Exception as error:  # noqa: BLE001 - model_signing raises ValueError, InvalidSignature, KeyError, ... on bad input
            raise ValueError(
                f"{signature} does not verify {model} with {public} (model_signing: {error})"
            ) from None
        raw = (folder / SIGNATURE_FILE).read_bytes()
        key = hashlib.sha256((folder / PUBLIC_KEY_FILE).read_bytes()).hexdigest()
    try:
        name, manifest = model_signature_subject(raw)
    except AttestationError as error:
        raise ValueError(f"{signature}: {error.message}") from None
    return name, manifest, key


def check_model(proof: Proof) -> ModelCheck:
    """Check the proof's attached model files; what the certificate may bind of them."""
    check = ModelCheck()
    rows = [
        row
        for row in ProofArtifact.objects.filter(proof=proof, name__startswith=f"{MODEL_DIR}/")
        .select_related("blob")
        .order_by("name")
        if model_names(row.name)
    ]
    stored = {row.name: (row.blob.storage_name, row.size) for row in rows}
    weights = [row for row in rows if row.name.endswith(".safetensors")]
    if not weights:
        return check
    if final_parameters(proof) is None:
        check.problem = "the transcript has no final parameter root to compare the model with"
        return check
    for row in weights:
        problem = check_weights(proof, row.name, row.blob.storage_name, row.size)
        if problem is not None:
            check.problem = problem
            check.files = []
            return check
        check.files.append({"name": Path(row.name).name, "sha256": row.sha256, "size": row.size})
    if f"{MODEL_DIR}/{SIGNATURE_FILE}" in stored:
        if len(weights) != 1:
            check.signature_problem = "a model signature over several weight files is not supported"
        else:
            try:
                name, manifest, key = check_signature(stored, weights[0].name)
            except ValueError as error:
                check.signature_problem = str(error)
            else:
                check.manifest = (name, manifest)
                check.public_key_sha256 = key
    return check


def model_claim(check: ModelCheck) -> Claim | None:
    """The ``final_model`` claim, or None when the trainer attached no model."""
    if not check.present:
        return None
    value: dict[str, Any] = {
        "files": check.files,
        "matches_final_parameter_root": check.problem is None,
        "problem": check.problem,
        "model_signing": None,
    }
    if check.manifest is not None:
        value["model_signing"] = {
            "model": check.manifest[0],
            "manifest_sha256": check.manifest[1],
            "public_key_sha256": check.public_key_sha256,
            "verified": True,
        }
    elif check.signature_problem is not None:
        value["model_signing"] = {"verified": False, "problem": check.signature_problem}
    # The platform recomputed the weights' state root and compared it with the one the
    # hash chain commits: the weights are bound by the transcript, not replayed.
    return Claim(CLAIM_MODEL, value, Evidence.COMMITTED)


# --- subjects ---------------------------------------------------------------------------


def weights_sha256(check: ModelCheck) -> str | None:
    """The SHA-256 of the final model's weights file, when there is exactly one.

    It goes into the ``zkdv/final-parameters`` subject beside the state root: the bytes
    an auditor holds for those parameters. Sharded weights have no one file to name.
    """
    if check.problem is None and len(check.files) == 1:
        return str(check.files[0]["sha256"])
    return None


def file_subjects(proof: Proof, check: ModelCheck) -> tuple[Subject, ...]:
    """``sha256`` subjects: the transcript file, and the model's files and manifest."""
    subjects = [Subject(SUBJECT_TRANSCRIPT_FILE, {DIGEST_SHA256: proof.transcript.sha256})]
    if check.problem is None:
        taken = {SUBJECT_TRANSCRIPT_FILE}
        for item in check.files:
            if item["name"] not in taken:
                taken.add(item["name"])
                subjects.append(Subject(item["name"], {DIGEST_SHA256: item["sha256"]}))
        if check.manifest is not None:
            name, manifest = check.manifest
            subjects.append(
                Subject(f"{SUBJECT_MODEL_SIGNING_PREFIX}{name}", {DIGEST_SHA256: manifest})
            )
    return tuple(subjects)


# --- regulatory thresholds ----------------------------------------------------------------


@dataclass(frozen=True)
class Threshold:
    """A named compute threshold (``DVBENCH_REGULATORY_THRESHOLDS``).

    ``counts`` is ``run`` (the certified run's compute) or ``lineage`` (the run's and its
    declared parent runs': :func:`lineage_claim`).
    """

    name: str
    flops: int
    description: str
    counts: str = "run"


def thresholds() -> list[Threshold]:
    """The configured thresholds, in the order settings list them."""
    return [
        Threshold(
            str(item["name"]),
            int(item["flops"]),
            str(item.get("description", "")),
            str(item.get("counts", "run")),
        )
        for item in settings.DVBENCH["REGULATORY_THRESHOLDS"]
    ]


def threshold_claim(claims: Sequence[Claim]) -> Claim:
    """``regulatory_thresholds``: each threshold and whether the compute it counts stays at
    or below it.

    ``stays_below`` is true when the compute is at most the threshold (the AI Act's
    presumptions apply to compute *greater than* theirs), false above, and null when it
    is undetermined. A ``run`` threshold counts the run's ``flops`` claim, a ``lineage``
    one the ``lineage`` claim's total (the run and its declared parents); ``flops`` is
    the number compared. The evidence level is the weakest of the claims it counts: a
    bound is no stronger than the number it bounds.
    """
    compute = next((claim for claim in claims if claim.name == "flops"), None)
    lineage = next((claim for claim in claims if claim.name == CLAIM_LINEAGE), None)
    counted = {
        "run": _number(compute.value if compute is not None else None),
        "lineage": _number(lineage.value.get("flops") if lineage is not None else None),
    }
    if lineage is None:  # a claim set from before lineages: the run is its own lineage
        counted["lineage"] = counted["run"]
    rows = []
    for threshold in thresholds():
        flops = counted[threshold.counts]
        rows.append(
            {
                "name": threshold.name,
                "threshold": threshold.flops,
                "counts": threshold.counts,
                "flops": None if flops is None else _limit_number(flops),
                "stays_below": None if flops is None else flops <= threshold.flops,
                "description": threshold.description,
            }
        )
    evidence = compute.evidence if compute is not None else Evidence.REPORTED
    if lineage is not None and any(threshold.counts == "lineage" for threshold in thresholds()):
        evidence = _weakest(evidence, lineage.evidence)
    return Claim(CLAIM_THRESHOLDS, rows, evidence, "FLOP")


def _weakest(*levels: Evidence) -> Evidence:
    return max(levels, key=_EVIDENCE_ORDER.index)


# --- lineage --------------------------------------------------------------------------


def lineage_claim(
    proof: Proof, claims: Sequence[Claim], initial_root: str | None, transcript_digest: str
) -> Claim:
    """``lineage``: the run's compute added to that of the runs its model descends from.

    The parent is the certified run the spec declares (``parent_transcript``, a transcript
    digest), else the lab's certified run whose committed final parameters are exactly
    this run's committed initial ones (``initial_root``): a fine-tune or RL run filed
    without its parent is found by its weights. Among several certificates of one parent run the
    earliest PASSED one counts. The parent's figure is its own certificate's lineage
    total, so a chain of runs adds up one signed step at a time.

    The value: ``flops`` (the total; null when any part is undetermined or a declared
    parent is not certified), ``runs`` (how many runs it adds up), ``parent_transcript``,
    ``parent_certificate``, ``declared`` (the spec names the parent) and
    ``starts_from_parent`` (this run's initial parameter root is the parent's final one:
    the link is committed, not only declared). The evidence is the weakest of this run's
    ``flops`` claim, the parent's lineage claim and the link.
    """
    compute = next((claim for claim in claims if claim.name == "flops"), None)
    own = _number(compute.value if compute is not None else None)
    evidence = compute.evidence if compute is not None else Evidence.REPORTED
    declared = proof.spec.parent_transcript
    candidates = Certificate.objects.exclude(proof=proof)
    if declared:
        candidates = candidates.filter(transcript_digest=declared)
    elif initial_root:
        # Only the lab's own runs: another lab's certificate is not its to name.
        candidates = candidates.filter(
            final_parameter_root=initial_root, organization_id=proof.experiment.owner_id
        ).exclude(transcript_digest=transcript_digest)
    else:
        candidates = candidates.none()
    passed_first = models.Case(models.When(result=CertificateResult.PASSED, then=0), default=1)
    parent = candidates.order_by(passed_first, "issued", "id").first()
    value: dict[str, Any] = {
        "flops": None if own is None else _limit_number(own),
        "runs": 1,
        "parent_transcript": declared or None,
        "parent_certificate": None,
        "declared": bool(declared),
        "starts_from_parent": None,
    }
    if declared and parent is None:
        # Declared, but no certificate of it (yet): the lineage's compute is unknown.
        value["flops"] = None
        return Claim(CLAIM_LINEAGE, value, Evidence.REPORTED, "FLOP")
    if parent is None:
        return Claim(CLAIM_LINEAGE, value, evidence, "FLOP")
    # The parent's own lineage claim, read from its signed statement once (None for a
    # certificate from before lineages: its run is its lineage, the trainer's word).
    signed = next((c for c in parent.claims() if c.get("name") == CLAIM_LINEAGE), None)
    upstream = signed.get("value") if signed is not None else None
    upstream_flops = (
        _number(upstream.get("flops"))
        if isinstance(upstream, dict)
        else (Decimal(parent.flops) if parent.flops is not None else None)
    )
    starts = bool(initial_root) and initial_root == parent.final_parameter_root
    total = None if own is None or upstream_flops is None else own + upstream_flops
    value.update(
        flops=None if total is None else _limit_number(total),
        runs=1 + (int(upstream.get("runs", 1)) if isinstance(upstream, dict) else 1),
        parent_transcript=parent.transcript_digest,
        parent_certificate=parent.pk,
        starts_from_parent=starts,
    )
    upstream_evidence = Evidence(signed["evidence"]) if signed is not None else Evidence.REPORTED
    link = Evidence.COMMITTED if starts else Evidence.REPORTED
    return Claim(CLAIM_LINEAGE, value, _weakest(evidence, upstream_evidence, link), "FLOP")


def _number(value: Any) -> Decimal | None:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return Decimal(str(value)) if numeric else None


# --- the detection guarantee ----------------------------------------------------------------


def _exact(steps: int, fraction: float | None, drawn: int) -> float:
    """``1 - C(T - F, m) / C(T, m)``: the chance that ``m`` distinct uniform draws hit a forged step."""
    import math

    if not steps or not fraction or not drawn:
        return 0.0
    forged = max(1, math.ceil(fraction * steps))
    miss = 1.0
    for k in range(drawn):
        miss *= max(0.0, (steps - forged - k) / (steps - k))
    return 1.0 - miss


#: What the forgery benchmark measured of the forgers that know the drift test: the
#: largest effect of those it does not catch, a measured number with its recipe and not a
#: guarantee. Copied from docs/soundness.md ("The best undetected effect"), which
#: ``python bench/forgery_suite.py --update-docs`` regenerates;
#: tests/agent/zkdv/torch/test_forgery_suite.py fails when the two differ.
MEASURED_UNDETECTED: Final = (
    "measured, not guaranteed: bench/forgery_suite.py (docs/soundness.md, 'The best "
    "undetected effect'; Torch LM recipe, bf16 bounds, 96 steps, default policy, seeds 0 "
    "and 1, 400 platform draws each) ran 13 forgers that know the drift test. Of those "
    "caught in fewer than 0.95 of trials, the largest backdoor: tolerance-gap-signed-2, "
    "backdoor success 0.000 of triggered inputs, caught in 0.729; of those caught in "
    "fewer than 0.05: tolerance-gap-biased-75, backdoor success 0.000, caught in 0.000 "
    "(the target's mean probability after the trigger 0.012 against the honest model's "
    "0.0073; the model 0.108 of the honest run's travel away from the honest one). Not "
    "a bound for longer runs: a forger pushing one step per snapshot window "
    "(tolerance-gap-spread, 0.086 of the every-step forger's push) gives no replayed "
    "window two differing steps, so the drift test never sees it, and its pushes add up "
    "with the run's length"
)


def _budget(bounds: Mapping[str, float]) -> dict[str, Any]:
    """What a forger can change per step within the gradient bounds (docs/transcript.md)."""
    tensor, total, scale = bounds["tensor"], bounds["total"], bounds["scale"]
    return {
        "gradient": (
            f"per step, each tensor of the committed gradient within {tensor:g} of its "
            f"norm plus {total:g} of the whole gradient's norm of the verifier's "
            f"recomputation (L2), and within {scale:g} of its norm plus {total:g} of the "
            f"whole gradient's along its own direction; the whole gradient within "
            f"{scale:g} of its norm along itself"
        ),
        "state": "the optimizer applied to the committed gradient reproduces the committed "
        "parameters and optimizer state bit for bit: nothing else can differ",
        "accumulation": "each step is judged at its committed pre-state, reproduced exactly, "
        "so a deviation cannot carry over into the next step's bound; but the model "
        "integrates the committed gradients, so pushes that keep one direction add up. A "
        "replay on other hardware therefore also fails a window whose committed-minus-"
        "recomputed differences align step after step (exact sign-flip p-value at most "
        f"{WINDOW_P:g}), and the run whose challenged windows together do (its sign-flip "
        f"p-value at most {RUN_P:g}): a push that keeps its direction is caught once two "
        "windows of 12 steps are replayed, whatever its size; what a forger that knows "
        "the test keeps is stated in docs/soundness.md, (a)",
        "measured": MEASURED_UNDETECTED,
    }


#: How closely a replayed step matched, loosest last: bit for bit, within the gradient
#: bounds, within the tolerance.
_MATCH_ORDER: Final = {"exact": 0, "bounds": 1, "tolerance": 2}


def _replay_matches(
    challenges: Sequence[tuple[int, int | None, str, Any]],
) -> dict[int, tuple[str, float | None]]:
    """How each replayed step matched (its loosest match and margin).

    Read from the evidence of the passed challenges; a step replayed more than once keeps
    its loosest match, and within bounds its largest divergence-to-bound ratio.
    """
    matched: dict[int, tuple[str, float | None]] = {}
    for _, _, status, evidence in challenges:
        if status != ChallengeStatus.PASSED or not isinstance(evidence, Mapping):
            continue
        for item in evidence.get("evidence") or []:
            if not isinstance(item, Mapping) or not isinstance(item.get("step"), int):
                continue
            gradient = item.get("gradient")
            state = item.get("state")
            tolerance = state == "tolerance" or (state is None and not gradient)
            kind = "exact" if item.get("exact") else "tolerance" if tolerance else "bounds"
            margin = gradient.get("margin") if isinstance(gradient, Mapping) else None
            previous = matched.get(item["step"])
            if previous is None or (_MATCH_ORDER[kind], margin or 0.0) > (
                _MATCH_ORDER[previous[0]],
                previous[1] or 0.0,
            ):
                matched[item["step"]] = (kind, margin)
    return matched


def _replayed_steps(matched: Mapping[int, tuple[str, float | None]]) -> dict[str, Any]:
    return {
        "exact": sorted(step for step, (kind, _) in matched.items() if kind == "exact"),
        "within_bounds": [
            [step, margin] for step, (kind, margin) in sorted(matched.items()) if kind == "bounds"
        ],
        "within_tolerance": sorted(
            step for step, (kind, _) in matched.items() if kind == "tolerance"
        ),
    }


def guarantee_claim(
    proof: Proof, tolerance: Mapping[str, float], bounds: Mapping[str, float] | None = None
) -> Claim:
    """``detection_guarantee``: what the platform's challenges guarantee about this run.

    ``challenges`` is ``m``, the number of distinct steps drawn uniformly at random
    (step 0 and the self-checked steps are replayed too, but a forger knows them in
    advance, so they do not count); ``detection_probability`` is ``1 - (1 - f)^m``, a
    lower bound on catching a run with a fraction ``f`` of forged steps (sampling
    without replacement does at least as well: ``provers/challenges.py``).
    ``detection_probability_exact`` is the exact probability for this run's length,
    ``1 - C(T - F, m) / C(T, m)`` with ``F = ceil(f T)`` forged of ``T`` steps, which the
    platform drew ``m`` to bring to at least ``target``. ``comparison`` says how the
    replays matched: ``exact`` when every replayed step reproduced the committed step
    bit for bit, ``bounds`` when some recomputed gradient matched the committed one only
    within the run's ``gradient_bounds`` (the state still bit for bit: replays on other
    hardware), ``tolerance`` when some step's post-update state (a step without committed
    gradient, or with an update that is not canonical) matched only within
    ``tolerance`` (``|replayed - committed| <= abs + rel * |committed|``).
    ``forger_budget`` states what the bounds leave a forger per step; ``drift`` is the
    drift test of every window replayed within bounds and of the run
    (:func:`platforms.drift`); ``replayed_steps``
    says how each replayed step matched (its worst divergence-to-bound ratio, for steps
    within bounds); ``judgement`` lists the steps replayed in the run's own replay
    environment, where only the committed bits pass (``exact``), and those replayed
    elsewhere and judged by the bounds (``within_bounds``), and those whose post-update
    state passed only within the probes' tolerance (``within_tolerance``: never the
    exact guarantee); ``update`` says how the run's update is judged for every step
    (``state``: ``exact`` or ``within_tolerance``, with the ``reason``:
    :func:`platforms.update_path`); ``not_replayed`` names the
    steps no worker of the run's platform kind replayed (reason ``no_replay_worker``),
    and then no detection probability is claimed; ``environments`` names the training
    machine (from the transcript: its platform kind, chip, versions, flags and replay
    environment key) and the platform's replay workers, each with its judgement, the
    keys it differs in from the training machine, and its steps
    (:mod:`attestations.certificates.platforms`).
    """
    from provers.challenges import random_steps_needed

    steps = max(0, int(proof.steps))
    target = proof.challenge_target
    fraction = proof.challenge_forged_fraction
    challenges = list(
        Challenge.objects.filter(proof=proof).values_list("step", "through", "status", "evidence")
    )
    drawn = 0
    if challenges and target is not None and fraction and steps:
        drawn = min(random_steps_needed(steps, target=target, forged_fraction=fraction), steps)
    matched = _replay_matches(challenges)
    kinds = {kind for kind, _ in matched.values()}
    comparison = None if not kinds else max(kinds, key=_MATCH_ORDER.__getitem__)
    root = (proof.report or {}).get("root") or {}
    trained = platforms.training(root)
    missing = platforms.not_replayed(challenges, trained["platform_kind"])
    # Steps without a replay guarantee nothing by replay: no probability is claimed.
    probability = 1.0 - (1.0 - fraction) ** drawn if fraction and drawn and not missing else 0.0
    value = {
        "steps": steps,
        "challenged_steps": len({step for step, _, _, _ in challenges}),
        "challenges": drawn,
        "forged_fraction": fraction,
        "detection_probability": probability,
        "detection_probability_exact": 0.0 if missing else _exact(steps, fraction, drawn),
        "target": target,
        "tolerance": dict(tolerance),
        "comparison": comparison,
        "gradient_bounds": None if bounds is None else dict(bounds),
        "forger_budget": None if bounds is None else _budget(bounds),
        "replayed_steps": _replayed_steps(matched),
        "judgement": platforms.judgements(challenges),
        "update": platforms.update_path(root),
        "drift": platforms.drift(challenges),
        "not_replayed": missing,
        "environments": {"training": trained, "replay": platforms.workers(challenges)},
    }
    evidence_level = Evidence.REPLAYED if challenges and not missing else Evidence.COMMITTED
    return Claim(CLAIM_DETECTION, value, evidence_level)
