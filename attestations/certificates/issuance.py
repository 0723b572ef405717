"""Certificate issuance: what a proof's certificate states, signed and logged once.

The cryptography is ``dvbench.attest`` (DSSE, in-toto); this module decides *what* is
certified: the run's claims and the limits it broke, the replay evidence, every filing of
the run, and the subjects of ``attestations/certificates/subjects.py``. The key that signs
comes from ``attestations/certificates/keys.py``; the entry is appended to the log of
``attestations/certificates/translog.py`` under the lock both share.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from django.db import IntegrityError, transaction

from attestations.audit.models import AuditEvent
from attestations.certificates import keys, translog
from attestations.certificates.claims import compute_claims, lineage_total, whole_claim
from attestations.certificates.models import Certificate, LogEntry, TrustRootVersion
from attestations.certificates.subjects import (
    check_model,
    file_subjects,
    guarantee_claim,
    lineage_claim,
    model_claim,
    threshold_claim,
    weights_sha256,
)
from attestations.challenges.models import Challenge
from attestations.core.validators import SHA256_HEX
from attestations.proofs.models import Proof, ProofStatus
from dvbench.attest import (
    Claim,
    Evidence,
    Filing,
    Filings,
    LogEntryRef,
    ReplayEvidence,
    Result,
    RunFiling,
    RunFilings,
    SigningKey,
    TrainingCertificate,
    dsse_entry_body,
    inclusion_promise_payload,
    note_key_id,
    sign_certificate,
)

log = logging.getLogger(__name__)

__all__ = [
    "CERTIFIED_STATUSES",
    "NO_REPLAY_SEED",
    "CertificateNotIssuableError",
    "issue_certificate",
]

#: Proof statuses whose verdict is final and certified (``error`` is the verifier's
#: failure, not a verdict on the run, so it gets no certificate).
CERTIFIED_STATUSES: Final = frozenset({ProofStatus.VALID, ProofStatus.REJECTED})
#: The seed recorded for a run that was never challenged (rejected before replay):
#: 32 zero bytes with no challenged steps. A real seed is 32 random bytes.
NO_REPLAY_SEED: Final = "00" * 32


class CertificateNotIssuableError(Exception):
    """The proof cannot be certified (yet): its verdict is not final, or a subject is unknown."""


def _verifier_version() -> str:
    try:
        return importlib.metadata.version("dvbench-platform")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# --- claims and replay evidence -----------------------------------------------------


@dataclass(frozen=True)
class _ClaimSet:
    claims: tuple[Claim, ...]
    #: The ``lineage`` claim (``certificates/subjects.py``), stated after the run's claims.
    lineage: Claim
    violations: tuple[dict[str, Any], ...] = field(default=())


def _claims(proof: Proof, transcript_digest: str) -> _ClaimSet:
    """The proof's policy claims (``attestations.certificates.claims``) and the limits it broke.

    The broken limits are signed too, as the claim ``limit_violations`` (a list of
    ``{limit, declared, actual, step, message}``, empty for a run within its limits);
    a transcript the claims could not be read to the end of counts as a violation,
    since its limits could not be checked, and so does a run declared as pre-training
    that continues a certified run (:func:`_continued_pretraining`).
    """
    claim_set = compute_claims(proof)
    root_details = claim_set.details.get("final_parameter_root") or {}
    lineage = lineage_claim(
        proof, claim_set.claims, root_details.get("initial_parameter_root"), transcript_digest
    )
    violations = [dict(violation.to_dict()) for violation in claim_set.violations]
    violations.extend(_continued_pretraining(claim_set.claims, lineage))
    if claim_set.transcript_error:
        violations.append(
            {
                "limit": "transcript",
                "declared": None,
                "actual": None,
                "step": None,
                "message": f"the transcript could not be read to its end: "
                f"{claim_set.transcript_error}",
            }
        )
    # Through JSON once: a declared limit may be a Decimal, which a statement cannot hold.
    signed = json.loads(json.dumps(violations, default=str))
    claims = (*claim_set.claims, Claim("limit_violations", signed, Evidence.COMMITTED))
    return _ClaimSet(claims=claims, lineage=lineage, violations=tuple(signed))


def _continued_pretraining(claims: tuple[Claim, ...], lineage: Claim) -> list[dict[str, Any]]:
    """A run that declares ``pretraining`` but has a parent (declared in its spec, or its
    initial parameters are a certified run's final ones) is a continuation filed as
    pre-training: the parent's compute would be off its claims."""
    regime = next((claim.value for claim in claims if claim.name == "regime"), None)
    declared = regime.get("declared_by_trainer") if isinstance(regime, dict) else None
    parent = lineage.value.get("parent_certificate")
    if declared != "pretraining" or parent is None:
        return []
    how = (
        "its initial parameters are the final parameters of"
        if lineage.value.get("starts_from_parent")
        else "its spec declares as its parent"
    )
    return [
        {
            "limit": "regime",
            "declared": "pretraining",
            "actual": f"continues certificate {parent}",
            "step": 0,
            "message": f"the run declares regime 'pretraining', but {how} the run of "
            f"certificate {parent} (transcript {lineage.value.get('parent_transcript')}): "
            "a continuation, whose parent's compute pre-training would leave out",
        }
    ]


def _numbers(values: Any) -> dict[str, float]:
    return {
        name: value
        for name, value in (values or {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def _replay_evidence(proof: Proof) -> ReplayEvidence:
    report: Mapping[str, Any] = proof.report or {}
    config = (report.get("root") or {}).get("config") or {}
    tolerance = _numbers(config.get("tolerance"))
    bounds = _numbers(config.get("bounds")) or None
    seed = proof.revealed_seed
    if not seed:
        return ReplayEvidence(NO_REPLAY_SEED, (), tolerance, bounds)
    steps: set[int] = set()
    for step, through in Challenge.objects.filter(proof=proof).values_list("step", "through"):
        steps.update(range(step, (through if through is not None else step) + 1))
    return ReplayEvidence(seed, tuple(sorted(steps)), tolerance, bounds)


def _filings(proof: Proof) -> Filings:
    """Every proof filed for the proof's experiment now, oldest first, as it stands.

    Signed into the certificate: a run re-filed until a draw missed its forged steps
    would show every abandoned or rejected try beside the one certified.
    """
    rows = (
        Proof.objects.filter(experiment_id=proof.experiment_id)
        .select_related("transcript")
        .order_by("pk")
    )
    filings = tuple(
        Filing(
            proof=row.pk,
            transcript_sha256=row.transcript.sha256,
            transcript_digest=row.transcript_digest
            if SHA256_HEX.match(row.transcript_digest)
            else None,
            status=str(row.status),
            reason=row.reason,
            filed_on=row.created,
            challenge_filing=row.challenge_filing,
        )
        for row in rows
    )
    return Filings(count=len(filings), proofs=filings, run=_run_filings(proof))


def _run_filings(proof: Proof) -> RunFilings | None:
    """The proof's committed run and its other filings, anywhere, as they stand.

    The plan depends on the run digest and the platform's key only, so a filing of the
    same run in another experiment or lab faced the same steps. Signed as dates, verdicts
    and digests, never as organisation, experiment or proof: the certificate's auditors
    read it, and another lab's identity is not theirs to see (regulators read it whole
    from :meth:`~attestations.certificates.models.Certificate.run_filings`).
    """
    digest = proof.challenge_run_digest
    if not digest:
        return None
    rows = (
        Proof.objects.filter(challenge_run_digest=digest, challenges_drawn__isnull=False)
        .exclude(experiment_id=proof.experiment_id)
        .select_related("experiment")
        .order_by("created", "pk")
    )
    owner = proof.experiment.owner_id
    elsewhere = tuple(
        RunFiling(
            filed_on=row.created,
            status=str(row.status),
            reason=row.reason,
            transcript_digest=row.transcript_digest,
            same_organization=row.experiment.owner_id == owner,
            challenge_target=float(row.challenge_target or 0.0),
        )
        for row in rows
    )
    return RunFilings(digest=digest, count=len(elsewhere), elsewhere=elsewhere)


def _subjects(proof: Proof) -> tuple[str, str]:
    report: Mapping[str, Any] = proof.report or {}
    digest = proof.transcript_digest or report.get("digest") or ""
    final = report.get("final") or {}
    root = final.get("p") if isinstance(final, Mapping) else None
    for what, value in (("transcript digest", digest), ("final parameter root", root)):
        if not isinstance(value, str) or len(value) != 64:
            raise CertificateNotIssuableError(
                f"proof {proof.pk} has no {what} (the transcript never reached its close "
                "record), so there is nothing a certificate could name"
            )
    return str(digest), str(root)


# --- issuance -------------------------------------------------------------------------


def issue_certificate(proof_id: int) -> Certificate:
    """Sign, log and store the certificate of a proof with a final verdict; idempotent.

    Returns the proof's certificate: the one already issued, if any. Two concurrent
    calls serialise on the log lock and the second returns the first's certificate; the
    unique constraint on ``Certificate.proof`` backs that up.

    Raises:
        Proof.DoesNotExist: no such proof.
        CertificateNotIssuableError: the verdict is not final or a subject is unknown.
        KeyConfigurationError: the signing key is unusable or not the trust root's current key.
    """
    try:
        with transaction.atomic():
            keys.lock_log()
            existing = Certificate.objects.filter(proof_id=proof_id).first()
            if existing is not None:
                return existing
            return _issue(
                Proof.objects.select_related("experiment__owner", "spec", "transcript").get(
                    pk=proof_id
                )
            )
    except IntegrityError:
        # Another process won a race the lock should have prevented (e.g. SQLite in a
        # deferred transaction): its certificate stands, this attempt rolled back.
        translog.reset_tree()
        existing = Certificate.objects.filter(proof_id=proof_id).first()
        if existing is None:
            raise
        return existing
    except BaseException:
        # A rolled-back append may have left its leaf in the cached tree. The next use
        # would notice by the last-leaf check; a reset is cheap and certain.
        translog.reset_tree()
        raise


@dataclass(frozen=True)
class _Signer:
    """The key that signs now, the trust root version that names it, and the signing time."""

    key: SigningKey
    root: TrustRootVersion
    moment: datetime


def _issue(proof: Proof) -> Certificate:
    _check_issuable(proof)
    transcript_digest, parameter_root = _subjects(proof)
    signer = _current_signer()
    claim_set = _claims(proof, transcript_digest)
    certificate = _statement(proof, claim_set, signer, transcript_digest, parameter_root)
    entry = _sign_and_log(certificate, signer)
    return _store(proof, certificate, claim_set, signer, entry)


def _check_issuable(proof: Proof) -> None:
    if proof.status not in CERTIFIED_STATUSES:
        raise CertificateNotIssuableError(
            f"proof {proof.pk} is {proof.status!r}; certificates are issued for "
            f"{sorted(CERTIFIED_STATUSES)} only"
        )
    if proof.is_duplicate:
        raise CertificateNotIssuableError(
            f"proof {proof.pk} repeats a transcript already filed for "
            f"{proof.experiment.full_name}; that proof's certificate covers it"
        )


def _current_signer() -> _Signer:
    """The current signing key, registered in the trust root, and a time it may sign at."""
    key, source = keys.signing_key()
    root_row = keys.ensure_current(key, source)
    window = root_row.trust_root().key(key.keyid)
    # Never before the key's start: a rotation starts the new key at the next second.
    moment = max(keys.now(), window.not_before)
    window.check_valid_at(moment, "certificate")
    return _Signer(key, root_row, moment)


def _statement(
    proof: Proof,
    claim_set: _ClaimSet,
    signer: _Signer,
    transcript_digest: str,
    parameter_root: str,
) -> TrainingCertificate:
    """What the certificate states, placed at the log's next index (not yet signed)."""
    passed = proof.status == ProofStatus.VALID and not claim_set.violations
    replay = _replay_evidence(proof)
    model = check_model(proof)
    # Statements beside the run's claims (attestations/certificates/subjects.py).
    lineage = claim_set.lineage
    stated = (
        model_claim(model),
        lineage,
        threshold_claim((*claim_set.claims, lineage)),
        guarantee_claim(proof, replay.tolerance, replay.gradient_bounds),
    )
    claims = (*claim_set.claims, *(claim for claim in stated if claim is not None))
    index = translog.next_index()
    origin = keys.log_origin()
    return TrainingCertificate(
        transcript_digest=transcript_digest,
        final_parameter_root=parameter_root,
        verifier_id=keys.verifier_id(),
        verifier_version=_verifier_version(),
        issued_at=signer.moment,
        policy_digest=proof.spec.digest,
        result=Result.PASSED if passed else Result.FAILED,
        claims=claims,
        replay=replay,
        log=LogEntryRef(origin=origin, index=index),
        trust_root_version=signer.root.version,
        trust_root_digest=signer.root.digest,
        experiment=proof.experiment.full_name,
        extra_subjects=file_subjects(proof, model),
        transcript_sha256=proof.transcript.sha256,
        parameters_sha256=weights_sha256(model),
        filings=_filings(proof),
    )


def _sign_and_log(certificate: TrainingCertificate, signer: _Signer) -> LogEntry:
    """Sign the certificate, stamp its signature and append it to the log at its index."""
    key, moment = signer.key, signer.moment
    index, origin = certificate.log.index, certificate.log.origin
    envelope = sign_certificate(certificate, key)
    # The leaf is the Rekor dsse entry of the envelope (dvbench.attest._rekor); the
    # envelope itself is stored beside it, and the log's signed entry timestamp makes
    # the checkpoint's time (integratedTime) a signed time of this very entry.
    leaf = dsse_entry_body(envelope, key.public_key)
    promise = key.sign(
        inclusion_promise_payload(
            leaf,
            integrated_time=int(moment.timestamp()),
            log_index=index,
            log_id=note_key_id(origin, key.public_key),
        )
    )
    stamped = keys.timestamp_authority().stamp(
        base64.b64decode(envelope["signatures"][0]["sig"]), moment
    )
    return translog.append(
        index,
        leaf,
        envelope,
        inclusion_promise=promise,
        rfc3161_timestamp=stamped,
        key=key,
        moment=moment,
        origin=origin,
    )


def _store(
    proof: Proof,
    certificate: TrainingCertificate,
    claim_set: _ClaimSet,
    signer: _Signer,
    entry: LogEntry,
) -> Certificate:
    """The certificate's row beside its log entry, recorded in the audit trail."""
    index = certificate.log.index
    row = Certificate.objects.create(
        proof=proof,
        organization=proof.experiment.owner,
        experiment=proof.experiment.full_name,
        result=certificate.result.value,
        flops=whole_claim(claim_set.claims, "flops"),
        tokens=whole_claim(claim_set.claims, "tokens"),
        lineage_flops=lineage_total(certificate.claims),
        issued=signer.moment,
        keyid=signer.key.keyid,
        trust_root_version=signer.root.version,
        transcript_digest=certificate.transcript_digest,
        final_parameter_root=certificate.final_parameter_root,
        log_entry=entry,
    )
    AuditEvent.record(
        "certificate.issued",
        organization=proof.experiment.owner,
        target=row,
        detail={
            "proof": proof.pk,
            "result": row.result,
            "log_index": index,
            "keyid": signer.key.keyid,
            "violations": list(claim_set.violations),
        },
    )
    log.info("issued certificate %s for proof %s as log entry %s", row.pk, proof.pk, index)
    return row
