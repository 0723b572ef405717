"""in-toto Statement v1: subjects identified by digests, and a predicate about them.

A Statement (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md)
binds a predicate to subjects identified by digests::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "...", "digest": {"<algorithm>": "<lowercase hex>"}}],
     "predicateType": "<URI>",
     "predicate": {...}}

DVBench's training certificate is such a statement (``dvbench.attest._certificate``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dvbench.attest._encoding import array, canonical_json, obj, parse_json, string
from dvbench.attest._errors import MalformedInputError

__all__ = ["DIGEST_SHA256", "STATEMENT_TYPE", "Statement", "Subject"]

STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"
DIGEST_SHA256: Final = "sha256"

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
