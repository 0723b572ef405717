"""The proofs filed for a certificate's experiment, as the certificate records them.

A certificate's ``filings`` (``docs/certificates.md``) lists every proof filed for its
experiment at signing (:class:`Filings`, one :class:`Filing` each), and every filing of
the same committed run outside the experiment (:class:`RunFilings`, one
:class:`RunFiling` each), so that an auditor sees each try, not only the one certified.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dvbench.attest._encoding import (
    array,
    format_time,
    integer,
    obj,
    parse_time,
    sha256_hex,
    string,
    to_seconds,
)
from dvbench.attest._errors import MalformedInputError

__all__ = ["Filing", "Filings", "RunFiling", "RunFilings"]


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
            transcript_sha256=sha256_hex(entry["transcriptSha256"], f"{what}.transcriptSha256"),
            transcript_digest=None
            if digest is None
            else sha256_hex(digest, f"{what}.transcriptDigest"),
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
            transcript_digest=sha256_hex(entry["transcriptDigest"], f"{what}.transcriptDigest"),
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
            digest=sha256_hex(entry["digest"], f"{what}.digest"), count=count, elsewhere=elsewhere
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
