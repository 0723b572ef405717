"""The DVBench training certificate: an in-toto statement about a verified training run.

A DVBench certificate's subjects are the transcript (digest ``zkdv-transcript``: the
ZKDV BLAKE3 hash of the last record, which chains every record before it) and the final
parameters (digest ``zkdv-state-root``: the Merkle root of the parameter tree in the
close record). Further subjects carry plain ``sha256`` digests for tools that match
files by SHA-256: the transcript file as uploaded (:data:`SUBJECT_TRANSCRIPT_FILE`), the
final model's files when the trainer uploaded them (named as the files), and the
OpenSSF model-signing manifest of the model (``model_signing/<model name>``). Its
predicate, of type :data:`PREDICATE_TYPE_TRAINING`, is documented field by field in
``docs/certificates.md``; the proofs filed for the experiment that it records are
``dvbench.attest._filings``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from dvbench.attest._encoding import (
    array,
    format_time,
    hex_decode,
    integer,
    obj,
    parse_time,
    sha256_hex,
    string,
    to_seconds,
)
from dvbench.attest._errors import MalformedInputError
from dvbench.attest._filings import Filings
from dvbench.attest._intoto import DIGEST_SHA256, Statement, Subject

__all__ = [
    "DIGEST_STATE_ROOT",
    "DIGEST_TRANSCRIPT",
    "PREDICATE_TYPE_TRAINING",
    "SUBJECT_MODEL_SIGNING_PREFIX",
    "SUBJECT_PARAMETERS",
    "SUBJECT_TRANSCRIPT",
    "SUBJECT_TRANSCRIPT_FILE",
    "Claim",
    "Evidence",
    "LogEntryRef",
    "ReplayEvidence",
    "Result",
    "TrainingCertificate",
    "certificate_time",
]

PREDICATE_TYPE_TRAINING: Final = "https://dvbench.dev/attestation/training/v1"
SUBJECT_TRANSCRIPT: Final = "zkdv/transcript"
SUBJECT_PARAMETERS: Final = "zkdv/final-parameters"
DIGEST_TRANSCRIPT: Final = "zkdv-transcript"
DIGEST_STATE_ROOT: Final = "zkdv-state-root"
#: The sha256 subject of the transcript file exactly as uploaded.
SUBJECT_TRANSCRIPT_FILE: Final = "records.cborl"
#: ``model_signing/<model name>``: the sha256 subject of an OpenSSF model-signing manifest.
SUBJECT_MODEL_SIGNING_PREFIX: Final = "model_signing/"


class Result(enum.StrEnum):
    """The verification outcome a certificate records."""

    PASSED = "PASSED"
    FAILED = "FAILED"


class Evidence(enum.StrEnum):
    """How strongly a claim is backed, strongest first."""

    REPLAYED = "verified_by_replay"
    """The platform recomputed it by replaying challenged steps."""
    COMMITTED = "committed_in_transcript"
    """Bound by the transcript's hash chain, but not recomputed."""
    REPORTED = "reported_by_trainer"
    """The trainer's word only."""


def _json_value(value: object, what: str) -> None:
    # A claim's value must survive JSON unchanged; reject what json.dumps would mangle.
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise MalformedInputError(f"{what} must be a finite number")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _json_value(item, f"{what}[{index}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MalformedInputError(f"{what} has a non-string key {key!r:.40}")
            _json_value(item, f"{what}.{key}")
        return
    raise MalformedInputError(f"{what} is not a JSON value: {type(value).__name__}")


@dataclass(frozen=True)
class Claim:
    """One policy claim about the run.

    Attributes:
        name: e.g. ``"steps"``, ``"flops"``, ``"final_parameter_root"``.
        value: any JSON value.
        evidence: how strongly it is backed.
        unit: e.g. ``"FLOP"`` or ``"GPU-hour"``; None when dimensionless.
    """

    name: str
    value: Any
    evidence: Evidence
    unit: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "evidence": self.evidence.value,
            "unit": self.unit,
        }

    @classmethod
    def from_dict(cls, data: object, what: str) -> Claim:
        entry = obj(data, what, required=("name", "value", "evidence", "unit"))
        evidence = entry["evidence"]
        if not isinstance(evidence, str) or evidence not in {level.value for level in Evidence}:
            raise MalformedInputError(
                f"{what}.evidence must be one of {sorted(level.value for level in Evidence)}, got {evidence!r:.40}"
            )
        _json_value(entry["value"], f"{what}.value")
        unit = entry["unit"]
        return cls(
            name=string(entry["name"], f"{what}.name"),
            value=entry["value"],
            evidence=Evidence(evidence),
            unit=None if unit is None else string(unit, f"{what}.unit"),
        )


@dataclass(frozen=True)
class ReplayEvidence:
    """What the platform replayed.

    Attributes:
        challenge_seed: the revealed 32-byte seed (hex) from which the steps derive.
        challenged_steps: the replayed step indices, ascending.
        tolerance: the float tolerance replays were held to, the transcript's own
            ``{"abs": .., "rel": ..}``: ``|replayed - committed| <= abs + rel * |committed|``.
        gradient_bounds: for a run that commits its gradients, the bounds its recomputed
            gradients were held to, the transcript's own ``{"tensor", "total", "scale"}``
            (``zkdv.GradientBounds``); None otherwise (and in certificates from before).
    """

    challenge_seed: str
    challenged_steps: tuple[int, ...]
    tolerance: Mapping[str, float]
    gradient_bounds: Mapping[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "challengeSeed": self.challenge_seed,
            "challengedSteps": list(self.challenged_steps),
            "tolerance": dict(self.tolerance),
        }
        if self.gradient_bounds is not None:
            out["gradientBounds"] = dict(self.gradient_bounds)
        return out

    @classmethod
    def from_dict(cls, data: object, what: str) -> ReplayEvidence:
        entry = obj(
            data,
            what,
            required=("challengeSeed", "challengedSteps", "tolerance"),
            optional=("gradientBounds",),
        )
        seed = string(entry["challengeSeed"], f"{what}.challengeSeed")
        hex_decode(seed, f"{what}.challengeSeed", size=32)
        steps = tuple(
            integer(step, f"{what}.challengedSteps[{index}]")
            for index, step in enumerate(array(entry["challengedSteps"], f"{what}.challengedSteps"))
        )
        if list(steps) != sorted(set(steps)):
            raise MalformedInputError(f"{what}.challengedSteps must be strictly ascending")
        tolerance = entry["tolerance"]
        if not isinstance(tolerance, Mapping):
            raise MalformedInputError(f"{what}.tolerance must be a JSON object")
        for name, value in tolerance.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise MalformedInputError(f"{what}.tolerance.{name} must be a number")
        bounds = entry.get("gradientBounds")
        if bounds is not None:
            bounds = obj(bounds, f"{what}.gradientBounds", required=("tensor", "total", "scale"))
            for name, value in bounds.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise MalformedInputError(f"{what}.gradientBounds.{name} must be a number")
        return cls(
            challenge_seed=seed,
            challenged_steps=steps,
            tolerance=dict(tolerance),
            gradient_bounds=None if bounds is None else dict(bounds),
        )


@dataclass(frozen=True)
class LogEntryRef:
    """Where the certificate sits in the transparency log.

    The tree size, inclusion proof and checkpoint cannot be inside the certificate,
    because they are computed over it once it is appended; the bundle carries them, and
    :func:`~dvbench.attest.verify_bundle` checks that they prove this entry.

    Attributes:
        origin: the log's name (the checkpoint's first line).
        index: the certificate's leaf index, assigned before signing.
    """

    origin: str
    index: int

    def to_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "index": self.index}

    @classmethod
    def from_dict(cls, data: object, what: str) -> LogEntryRef:
        entry = obj(data, what, required=("origin", "index"))
        return cls(
            origin=string(entry["origin"], f"{what}.origin"),
            index=integer(entry["index"], f"{what}.index"),
        )


@dataclass(frozen=True)
class TrainingCertificate:
    """The DVBench certificate: what a verified (or rejected) training run gets.

    Build one, call :meth:`to_statement`, and sign the statement's JSON with
    :func:`~dvbench.attest.sign_certificate`. Every field is signed.

    Attributes:
        transcript_digest: hex ZKDV transcript digest (``VerificationReport.digest``).
        final_parameter_root: hex root of the final parameter tree (``final["p"]``).
        verifier_id: URI of the verifying service, e.g. ``https://dvbench.example``.
        verifier_version: its software version.
        issued_at: signing time; the signing key must be valid then.
        policy_digest: hex SHA-256 of the experiment's declared spec.
        result: PASSED or FAILED.
        claims: the policy claims.
        replay: the replay evidence.
        log: the log entry this certificate is appended as.
        trust_root_version: version of the trust root in force at signing.
        trust_root_digest: hex SHA-256 of that trust root's canonical JSON.
        experiment: optional experiment identifier (``org/name``).
        filings: every proof filed for the experiment at signing (absent from
            certificates signed before the platform recorded them).
        transcript_sha256: hex SHA-256 of the transcript file, also written into the
            ``zkdv/transcript`` subject beside its ZKDV digest, so that tools matching
            subjects by SHA-256 find it (None in certificates signed before).
        parameters_sha256: hex SHA-256 of the final model's weights file, when the trainer
            uploaded exactly one: written into the ``zkdv/final-parameters`` subject beside
            its state root (None otherwise, and in certificates signed before).
    """

    transcript_digest: str
    final_parameter_root: str
    verifier_id: str
    verifier_version: str
    issued_at: datetime
    policy_digest: str
    result: Result
    claims: tuple[Claim, ...]
    replay: ReplayEvidence
    log: LogEntryRef
    trust_root_version: int
    trust_root_digest: str
    experiment: str | None = None
    extra_subjects: tuple[Subject, ...] = field(default=())
    filings: Filings | None = None
    transcript_sha256: str | None = None
    parameters_sha256: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "issued_at", to_seconds(self.issued_at))
        object.__setattr__(self, "result", Result(self.result))
        hex_decode(self.transcript_digest, "transcript_digest", size=32)
        hex_decode(self.final_parameter_root, "final_parameter_root", size=32)
        hex_decode(self.policy_digest, "policy_digest", size=32)
        hex_decode(self.trust_root_digest, "trust_root_digest", size=32)

    def predicate(self) -> dict[str, Any]:
        """The predicate object (schema in ``docs/certificates.md``)."""
        predicate = {
            "verifier": {"id": self.verifier_id, "version": self.verifier_version},
            "issuedOn": format_time(self.issued_at),
            "experiment": self.experiment,
            "policyDigest": {"sha256": self.policy_digest},
            "result": self.result.value,
            "claims": [claim.to_dict() for claim in self.claims],
            "replay": self.replay.to_dict(),
            "log": self.log.to_dict(),
            "trustRoot": {
                "version": self.trust_root_version,
                "digest": {"sha256": self.trust_root_digest},
            },
        }
        if self.filings is not None:
            predicate["filings"] = self.filings.to_dict()
        return predicate

    def sha256_subject(self, name: str) -> str | None:
        """The ``sha256`` digest of the further subject called ``name``, if there is one."""
        for subject in self.extra_subjects:
            if subject.name == name:
                value = subject.digest.get(DIGEST_SHA256)
                return value if isinstance(value, str) else None
        return None

    def to_statement(self) -> Statement:
        """The in-toto Statement carrying this certificate."""
        transcript = {DIGEST_TRANSCRIPT: self.transcript_digest}
        if self.transcript_sha256 is not None:
            transcript[DIGEST_SHA256] = self.transcript_sha256
        parameters = {DIGEST_STATE_ROOT: self.final_parameter_root}
        if self.parameters_sha256 is not None:
            parameters[DIGEST_SHA256] = self.parameters_sha256
        subjects = (
            Subject(SUBJECT_TRANSCRIPT, transcript),
            Subject(SUBJECT_PARAMETERS, parameters),
            *self.extra_subjects,
        )
        return Statement(
            subjects=subjects, predicate_type=PREDICATE_TYPE_TRAINING, predicate=self.predicate()
        )

    @classmethod
    def from_statement(cls, statement: Statement) -> TrainingCertificate:
        """Read a certificate back from a verified statement.

        Raises:
            MalformedInputError: the statement is not a DVBench training certificate.
        """
        if statement.predicate_type != PREDICATE_TYPE_TRAINING:
            raise MalformedInputError(
                f"statement.predicateType must be {PREDICATE_TYPE_TRAINING!r}, "
                f"got {statement.predicate_type!r:.80}"
            )
        transcript = _single_digest(statement.subject(SUBJECT_TRANSCRIPT), DIGEST_TRANSCRIPT)
        parameters = _single_digest(statement.subject(SUBJECT_PARAMETERS), DIGEST_STATE_ROOT)
        transcript_sha256 = _optional_digest(statement.subject(SUBJECT_TRANSCRIPT), DIGEST_SHA256)
        parameters_sha256 = _optional_digest(statement.subject(SUBJECT_PARAMETERS), DIGEST_SHA256)
        what = "predicate"
        data = obj(
            statement.predicate,
            what,
            required=(
                "verifier",
                "issuedOn",
                "experiment",
                "policyDigest",
                "result",
                "claims",
                "replay",
                "log",
                "trustRoot",
            ),
            optional=("filings",),
        )
        verifier = obj(data["verifier"], f"{what}.verifier", required=("id", "version"))
        policy = obj(data["policyDigest"], f"{what}.policyDigest", required=("sha256",))
        result = data["result"]
        if not isinstance(result, str) or result not in {value.value for value in Result}:
            raise MalformedInputError(f"{what}.result must be PASSED or FAILED, got {result!r:.40}")
        trust = obj(data["trustRoot"], f"{what}.trustRoot", required=("version", "digest"))
        trust_digest = obj(trust["digest"], f"{what}.trustRoot.digest", required=("sha256",))
        experiment = data["experiment"]
        extra = tuple(
            subject
            for subject in statement.subjects
            if subject.name not in (SUBJECT_TRANSCRIPT, SUBJECT_PARAMETERS)
        )
        return cls(
            transcript_digest=transcript,
            final_parameter_root=parameters,
            verifier_id=string(verifier["id"], f"{what}.verifier.id"),
            verifier_version=string(verifier["version"], f"{what}.verifier.version"),
            issued_at=parse_time(data["issuedOn"], f"{what}.issuedOn"),
            policy_digest=sha256_hex(policy["sha256"], f"{what}.policyDigest.sha256"),
            result=Result(result),
            claims=tuple(
                Claim.from_dict(claim, f"{what}.claims[{index}]")
                for index, claim in enumerate(array(data["claims"], f"{what}.claims"))
            ),
            replay=ReplayEvidence.from_dict(data["replay"], f"{what}.replay"),
            log=LogEntryRef.from_dict(data["log"], f"{what}.log"),
            trust_root_version=integer(trust["version"], f"{what}.trustRoot.version", minimum=1),
            trust_root_digest=sha256_hex(trust_digest["sha256"], f"{what}.trustRoot.digest.sha256"),
            experiment=None if experiment is None else string(experiment, f"{what}.experiment"),
            extra_subjects=extra,
            filings=None
            if "filings" not in data
            else Filings.from_dict(data["filings"], f"{what}.filings"),
            transcript_sha256=transcript_sha256,
            parameters_sha256=parameters_sha256,
        )


def _optional_digest(subject: Subject, algorithm: str) -> str | None:
    value = subject.digest.get(algorithm)
    if value is None:
        return None
    return sha256_hex(value, f"subject {subject.name!r} digest {algorithm}")


def _single_digest(subject: Subject, algorithm: str) -> str:
    value = subject.digest.get(algorithm)
    if value is None:
        raise MalformedInputError(f"subject {subject.name!r} has no {algorithm!r} digest")
    return sha256_hex(value, f"subject {subject.name!r} digest {algorithm}")


def certificate_time(payload: bytes) -> datetime:
    """The signing time inside a certificate's verified payload (``predicate.issuedOn``).

    Raises:
        MalformedInputError: the payload is not a training certificate statement.
    """
    return TrainingCertificate.from_statement(Statement.from_json(payload)).issued_at
