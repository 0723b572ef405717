"""in-toto Statement v1 and the DVBench training certificate predicate.

A Statement (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md)
binds a predicate to subjects identified by digests::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "...", "digest": {"<algorithm>": "<lowercase hex>"}}],
     "predicateType": "<URI>",
     "predicate": {...}}

A DVBench certificate's subjects are the transcript (digest ``zkdv-transcript``: the
ZKDV BLAKE3 hash of the last record, which chains every record before it) and the final
parameters (digest ``zkdv-state-root``: the Merkle root of the parameter tree in the
close record). Further subjects carry plain ``sha256`` digests for tools that match
files by SHA-256: the transcript file as uploaded (:data:`SUBJECT_TRANSCRIPT_FILE`), the
final model's files when the trainer uploaded them (named as the files), and the
OpenSSF model-signing manifest of the model (``model_signing/<model name>``). Its
predicate, of type :data:`PREDICATE_TYPE_TRAINING`, is documented field by field in
``docs/certificates.md``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from dvbench.attest._encoding import (
    array,
    canonical_json,
    format_time,
    hex_decode,
    integer,
    obj,
    parse_json,
    parse_time,
    string,
    to_seconds,
)
from dvbench.attest._errors import MalformedInputError

__all__ = [
    "DIGEST_SHA256",
    "DIGEST_STATE_ROOT",
    "DIGEST_TRANSCRIPT",
    "MODEL_SIGNATURE_FILE",
    "PREDICATE_TYPE_TRAINING",
    "STATEMENT_TYPE",
    "SUBJECT_MODEL_SIGNING_PREFIX",
    "SUBJECT_PARAMETERS",
    "SUBJECT_TRANSCRIPT",
    "SUBJECT_TRANSCRIPT_FILE",
    "Claim",
    "Evidence",
    "LogEntryRef",
    "ReplayEvidence",
    "Result",
    "Statement",
    "Subject",
    "TrainingCertificate",
]

STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE_TRAINING: Final = "https://dvbench.dev/attestation/training/v1"
SUBJECT_TRANSCRIPT: Final = "zkdv/transcript"
SUBJECT_PARAMETERS: Final = "zkdv/final-parameters"
DIGEST_TRANSCRIPT: Final = "zkdv-transcript"
DIGEST_STATE_ROOT: Final = "zkdv-state-root"
DIGEST_SHA256: Final = "sha256"
#: The sha256 subject of the transcript file exactly as uploaded.
SUBJECT_TRANSCRIPT_FILE: Final = "records.cborl"
#: ``model_signing/<model name>``: the sha256 subject of an OpenSSF model-signing manifest.
SUBJECT_MODEL_SIGNING_PREFIX: Final = "model_signing/"
#: Where the SDK writes the model's OpenSSF model-signing signature, beside the weights.
MODEL_SIGNATURE_FILE: Final = "model.sig"
#: The predicate type of an OpenSSF model-signing (``model_signing`` 1.x) statement.
PREDICATE_TYPE_MODEL_SIGNING: Final = "https://model_signing/signature/v1.0"

_ALGORITHM = re.compile(r"[a-z0-9][a-z0-9-]*")
_HEX_DIGEST = re.compile(r"(?:[0-9a-f]{2})+")


@dataclass(frozen=True)
class Subject:
    """A software artifact the statement is about.

    Attributes:
        name: an identifier, unique within the statement.
        digest: algorithm -> lowercase hex digest; at least one entry.
    """

    name: str
    digest: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": dict(self.digest)}

    @classmethod
    def from_dict(cls, data: object, what: str) -> Subject:
        entry = obj(data, what, required=("name", "digest"))
        name = string(entry["name"], f"{what}.name")
        digests = entry["digest"]
        if not isinstance(digests, Mapping):
            raise MalformedInputError(f"{what}.digest must be a JSON object")
        if not digests:
            raise MalformedInputError(f"{what}.digest is empty")
        for algorithm, value in digests.items():
            if _ALGORITHM.fullmatch(algorithm) is None:
                raise MalformedInputError(
                    f"{what}.digest has a malformed algorithm name {algorithm!r:.40}"
                )
            if not isinstance(value, str) or _HEX_DIGEST.fullmatch(value) is None:
                raise MalformedInputError(f"{what}.digest.{algorithm} must be lowercase hex")
        return cls(name=name, digest=dict(digests))


@dataclass(frozen=True)
class Statement:
    """An in-toto Statement v1.

    Attributes:
        subjects: what the statement is about (non-empty, unique names).
        predicate_type: URI naming the predicate's schema.
        predicate: the predicate, a JSON object.
    """

    subjects: tuple[Subject, ...]
    predicate_type: str
    predicate: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "_type": STATEMENT_TYPE,
            "subject": [subject.to_dict() for subject in self.subjects],
            "predicateType": self.predicate_type,
            "predicate": dict(self.predicate),
        }

    def to_json(self) -> bytes:
        """Canonical JSON bytes, the DSSE payload; verifiers use the bytes as signed."""
        return canonical_json(self.to_dict())

    def subject(self, name: str) -> Subject:
        """The subject called ``name``.

        Raises:
            MalformedInputError: there is none.
        """
        for subject in self.subjects:
            if subject.name == name:
                return subject
        raise MalformedInputError(f"statement has no subject named {name!r}")

    @classmethod
    def from_dict(cls, data: object) -> Statement:
        """Parse and check a statement.

        Raises:
            MalformedInputError: it breaks the in-toto Statement v1 schema.
        """
        document = obj(
            data, "statement", required=("_type", "subject", "predicateType", "predicate")
        )
        if document["_type"] != STATEMENT_TYPE:
            raise MalformedInputError(
                f"statement._type must be {STATEMENT_TYPE!r}, got {document['_type']!r:.80}"
            )
        entries = array(document["subject"], "statement.subject")
        if not entries:
            raise MalformedInputError("statement.subject is empty")
        subjects = tuple(
            Subject.from_dict(entry, f"statement.subject[{index}]")
            for index, entry in enumerate(entries)
        )
        if len({subject.name for subject in subjects}) != len(subjects):
            raise MalformedInputError("statement.subject repeats a name")
        predicate_type = string(document["predicateType"], "statement.predicateType")
        predicate = document["predicate"]
        if not isinstance(predicate, Mapping):
            raise MalformedInputError("statement.predicate must be a JSON object")
        return cls(subjects=subjects, predicate_type=predicate_type, predicate=predicate)

    @classmethod
    def from_json(cls, data: bytes | str) -> Statement:
        return cls.from_dict(parse_json(data, "statement"))


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
class Filing:
    """One proof filed for the certificate's experiment, and where it stood at signing.

    Attributes:
        proof: the platform's proof id.
        transcript_sha256: hex SHA-256 of the transcript file as uploaded.
        transcript_digest: hex ZKDV transcript digest, once ingest read it (else None).
        status: ``pending``, ``verifying``, ``challenged``, ``valid``, ``rejected`` or
            ``error``, at signing.
        reason: the rejection reason (``challenge_expired`` for an abandoned proof), or "".
        filed_on: when it was filed.
        challenge_filing: its place among the experiment's challenged proofs, if drawn.
    """

    proof: int
    transcript_sha256: str
    transcript_digest: str | None
    status: str
    reason: str
    filed_on: datetime
    challenge_filing: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "filed_on", to_seconds(self.filed_on))

    def to_dict(self) -> dict[str, Any]:
        return {
            "proof": self.proof,
            "transcriptSha256": self.transcript_sha256,
            "transcriptDigest": self.transcript_digest,
            "status": self.status,
            "reason": self.reason,
            "filedOn": format_time(self.filed_on),
            "challengeFiling": self.challenge_filing,
        }

    @classmethod
    def from_dict(cls, data: object, what: str) -> Filing:
        entry = obj(
            data,
            what,
            required=(
                "proof",
                "transcriptSha256",
                "transcriptDigest",
                "status",
                "reason",
                "filedOn",
                "challengeFiling",
            ),
        )
        digest = entry["transcriptDigest"]
        filing = entry["challengeFiling"]
        return cls(
            proof=integer(entry["proof"], f"{what}.proof"),
            transcript_sha256=_sha256(entry["transcriptSha256"], f"{what}.transcriptSha256"),
            transcript_digest=None
            if digest is None
            else _sha256(digest, f"{what}.transcriptDigest"),
            status=string(entry["status"], f"{what}.status"),
            reason=string(entry["reason"], f"{what}.reason", empty=True),
            filed_on=parse_time(entry["filedOn"], f"{what}.filedOn"),
            challenge_filing=None
            if filing is None
            else integer(filing, f"{what}.challengeFiling", minimum=1),
        )


@dataclass(frozen=True)
class RunFiling:
    """One filing of the same committed run outside the certificate's experiment.

    It names no organisation, experiment or proof: the certificate's own auditors read
    it, and another lab's identity is not theirs to see. Regulators read the whole
    filing from the platform's API (docs/certificates.md).

    Attributes:
        filed_on: when it was filed.
        status: its verdict at signing (``challenged``, ``valid``, ``rejected``, ...).
        reason: the rejection reason (``challenge_expired`` for an abandoned proof), or "".
        transcript_digest: hex ZKDV transcript digest of that filing.
        same_organization: whether it was filed in the certificate's own organisation
            (another of its experiments) rather than in another one.
        challenge_target: the detection target its plan was drawn for.
    """

    filed_on: datetime
    status: str
    reason: str
    transcript_digest: str
    same_organization: bool
    challenge_target: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "filed_on", to_seconds(self.filed_on))

    def to_dict(self) -> dict[str, Any]:
        return {
            "filedOn": format_time(self.filed_on),
            "status": self.status,
            "reason": self.reason,
            "transcriptDigest": self.transcript_digest,
            "sameOrganization": self.same_organization,
            "challengeTarget": self.challenge_target,
        }

    @classmethod
    def from_dict(cls, data: object, what: str) -> RunFiling:
        entry = obj(
            data,
            what,
            required=(
                "filedOn",
                "status",
                "reason",
                "transcriptDigest",
                "sameOrganization",
                "challengeTarget",
            ),
        )
        same = entry["sameOrganization"]
        if not isinstance(same, bool):
            raise MalformedInputError(f"{what}.sameOrganization must be true or false")
        target = entry["challengeTarget"]
        if isinstance(target, bool) or not isinstance(target, int | float):
            raise MalformedInputError(f"{what}.challengeTarget must be a number")
        return cls(
            filed_on=parse_time(entry["filedOn"], f"{what}.filedOn"),
            status=string(entry["status"], f"{what}.status"),
            reason=string(entry["reason"], f"{what}.reason", empty=True),
            transcript_digest=_sha256(entry["transcriptDigest"], f"{what}.transcriptDigest"),
            same_organization=same,
            challenge_target=float(target),
        )


@dataclass(frozen=True)
class RunFilings:
    """The committed run of the certificate's proof, and every other filing of it.

    The challenge plan depends on the run digest and the platform's key only, so the
    same run filed in another experiment or another lab faces the same steps; these are
    the filings that did, anywhere on the platform, when the certificate was signed.

    Attributes:
        digest: hex run digest (``challenge_plan.run_digest``): what the seed derives from.
        count: how many filings of it there were outside this experiment.
        elsewhere: each of them, oldest first.
    """

    digest: str
    count: int
    elsewhere: tuple[RunFiling, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "count": self.count,
            "elsewhere": [filing.to_dict() for filing in self.elsewhere],
        }

    @classmethod
    def from_dict(cls, data: object, what: str) -> RunFilings:
        entry = obj(data, what, required=("digest", "count", "elsewhere"))
        elsewhere = tuple(
            RunFiling.from_dict(item, f"{what}.elsewhere[{index}]")
            for index, item in enumerate(array(entry["elsewhere"], f"{what}.elsewhere"))
        )
        count = integer(entry["count"], f"{what}.count")
        if count != len(elsewhere):
            raise MalformedInputError(
                f"{what}.count is {count} but {len(elsewhere)} filings are listed"
            )
        return cls(
            digest=_sha256(entry["digest"], f"{what}.digest"), count=count, elsewhere=elsewhere
        )


@dataclass(frozen=True)
class Filings:
    """Every proof filed for the experiment when the certificate was signed.

    A lab cannot re-file a run until a draw misses its forged steps without each try
    standing on the record: an auditor reads here how many proofs there were and how
    each ended (rejected, abandoned, still open), not only the one certified.

    Attributes:
        count: how many proofs were filed.
        proofs: each of them, oldest first.
        run: the certified proof's committed run and its filings outside the
            experiment, in any organisation (None when the proof was never challenged,
            and in certificates signed before it existed).
    """

    count: int
    proofs: tuple[Filing, ...]
    run: RunFilings | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "count": self.count,
            "proofs": [filing.to_dict() for filing in self.proofs],
        }
        if self.run is not None:
            out["run"] = self.run.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: object, what: str) -> Filings:
        entry = obj(data, what, required=("count", "proofs"), optional=("run",))
        proofs = tuple(
            Filing.from_dict(item, f"{what}.proofs[{index}]")
            for index, item in enumerate(array(entry["proofs"], f"{what}.proofs"))
        )
        count = integer(entry["count"], f"{what}.count")
        if count != len(proofs):
            raise MalformedInputError(
                f"{what}.count is {count} but {len(proofs)} proofs are listed"
            )
        run = entry.get("run")
        return cls(
            count=count,
            proofs=proofs,
            run=None if run is None else RunFilings.from_dict(run, f"{what}.run"),
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
            policy_digest=_sha256(policy["sha256"], f"{what}.policyDigest.sha256"),
            result=Result(result),
            claims=tuple(
                Claim.from_dict(claim, f"{what}.claims[{index}]")
                for index, claim in enumerate(array(data["claims"], f"{what}.claims"))
            ),
            replay=ReplayEvidence.from_dict(data["replay"], f"{what}.replay"),
            log=LogEntryRef.from_dict(data["log"], f"{what}.log"),
            trust_root_version=integer(trust["version"], f"{what}.trustRoot.version", minimum=1),
            trust_root_digest=_sha256(trust_digest["sha256"], f"{what}.trustRoot.digest.sha256"),
            experiment=None if experiment is None else string(experiment, f"{what}.experiment"),
            extra_subjects=extra,
            filings=None
            if "filings" not in data
            else Filings.from_dict(data["filings"], f"{what}.filings"),
            transcript_sha256=transcript_sha256,
            parameters_sha256=parameters_sha256,
        )


def _sha256(value: object, what: str) -> str:
    hex_decode(value, what, size=32)
    assert isinstance(value, str)
    return value


def _optional_digest(subject: Subject, algorithm: str) -> str | None:
    value = subject.digest.get(algorithm)
    if value is None:
        return None
    return _sha256(value, f"subject {subject.name!r} digest {algorithm}")


def _single_digest(subject: Subject, algorithm: str) -> str:
    value = subject.digest.get(algorithm)
    if value is None:
        raise MalformedInputError(f"subject {subject.name!r} has no {algorithm!r} digest")
    return _sha256(value, f"subject {subject.name!r} digest {algorithm}")


def model_signature_subject(signature: bytes) -> tuple[str, str]:
    """The model name and manifest digest an OpenSSF model signature (``model.sig``) signs.

    Reads the in-toto statement inside the signature's Sigstore bundle without checking
    its signature: that is ``model_signing verify``'s job; the certificate binds the
    manifest digest, so a signature over another manifest does not match it.

    Raises:
        SubjectMismatchError: the file is not a model_signing signature.
    """
    import base64
    import json

    from dvbench.attest._errors import SubjectMismatchError

    try:
        bundle = json.loads(signature)
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json.loads(payload)
        if statement.get("predicateType") != PREDICATE_TYPE_MODEL_SIGNING:
            raise ValueError(f"predicateType {statement.get('predicateType')!r}")
        (subject,) = statement["subject"]
        name, digest = subject["name"], subject["digest"][DIGEST_SHA256]
        if not isinstance(name, str) or not isinstance(digest, str):
            raise ValueError("subject name or digest is not a string")
    except (ValueError, KeyError, TypeError) as error:
        raise SubjectMismatchError(f"not an OpenSSF model_signing signature: {error}") from None
    return name, digest


def certificate_time(payload: bytes) -> datetime:
    """The signing time inside a certificate's verified payload (``predicate.issuedOn``).

    Raises:
        MalformedInputError: the payload is not a training certificate statement.
    """
    return TrainingCertificate.from_statement(Statement.from_json(payload)).issued_at
