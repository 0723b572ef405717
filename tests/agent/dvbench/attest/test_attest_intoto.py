"""in-toto Statement v1 and the training certificate predicate."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from dvbench.attest import (
    DIGEST_STATE_ROOT,
    DIGEST_TRANSCRIPT,
    PREDICATE_TYPE_TRAINING,
    STATEMENT_TYPE,
    SUBJECT_PARAMETERS,
    SUBJECT_TRANSCRIPT,
    Evidence,
    MalformedInputError,
    Result,
    Statement,
    Subject,
    TrainingCertificate,
    TrustRoot,
)


def test_certificate_statement_shape(trust_root_v1: TrustRoot, make_certificate: Any) -> None:
    certificate = make_certificate(trust_root_v1, index=4)
    document = json.loads(certificate.to_statement().to_json())
    assert document["_type"] == STATEMENT_TYPE == "https://in-toto.io/Statement/v1"
    assert document["predicateType"] == PREDICATE_TYPE_TRAINING
    assert document["subject"] == [
        {"name": SUBJECT_TRANSCRIPT, "digest": {DIGEST_TRANSCRIPT: "ab" * 32}},
        {"name": SUBJECT_PARAMETERS, "digest": {DIGEST_STATE_ROOT: "cd" * 32}},
    ]
    predicate = document["predicate"]
    assert predicate["verifier"] == {"id": "https://dvbench.example", "version": "0.1.0"}
    assert predicate["issuedOn"] == "2026-03-14T15:09:26Z"
    assert predicate["policyDigest"] == {"sha256": "ef" * 32}
    assert predicate["result"] == "PASSED"
    assert predicate["claims"][1] == {
        "name": "flops",
        "value": 3.25e18,
        "evidence": "verified_by_replay",
        "unit": "FLOP",
    }
    assert predicate["replay"] == {
        "challengeSeed": "5e" * 32,
        "challengedSteps": [0, 17, 512],
        "tolerance": {"rtol": 1e-5, "atol": 1e-6},
    }
    assert predicate["log"] == {"origin": "dvbench.example/log", "index": 4}
    assert predicate["trustRoot"] == {"version": 1, "digest": {"sha256": trust_root_v1.digest()}}
    assert predicate["experiment"] == "acme/run-7"


def test_certificates_round_trip(trust_root_v1: TrustRoot, make_certificate: Any) -> None:
    certificate = make_certificate(trust_root_v1, index=4, result=Result.FAILED)
    statement = Statement.from_json(certificate.to_statement().to_json())
    assert TrainingCertificate.from_statement(statement) == certificate
    assert certificate.claims[0].evidence is Evidence.COMMITTED


def test_extra_subjects_are_kept(trust_root_v1: TrustRoot, make_certificate: Any) -> None:
    from dataclasses import replace

    extra = Subject("examples/model.safetensors", {"sha256": "01" * 32})
    certificate = replace(make_certificate(trust_root_v1, index=0), extra_subjects=(extra,))
    again = TrainingCertificate.from_statement(
        Statement.from_json(certificate.to_statement().to_json())
    )
    assert again.extra_subjects == (extra,)


def test_bad_certificate_values_are_refused_when_built(
    trust_root_v1: TrustRoot, make_certificate: Any
) -> None:
    with pytest.raises(MalformedInputError, match="transcript_digest must be 32 bytes"):
        make_certificate(trust_root_v1, index=0, transcript_digest="ab")
    with pytest.raises(ValueError, match="'MAYBE' is not a valid Result"):
        make_certificate(trust_root_v1, index=0, result="MAYBE")


def _document(trust_root: TrustRoot, make_certificate: Any) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        make_certificate(trust_root, index=2).to_statement().to_json()
    )
    return document


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("_type",), "https://in-toto.io/Statement/v0.1", "statement._type must be"),
        (("subject",), [], "statement.subject is empty"),
        (("subject", 0, "digest"), {}, r"statement.subject\[0\].digest is empty"),
        (("subject", 0, "digest"), {DIGEST_TRANSCRIPT: "AB" * 32}, "must be lowercase hex"),
        (("subject", 1, "name"), SUBJECT_TRANSCRIPT, "repeats a name"),
        (("predicateType",), "https://slsa.dev/provenance/v1", "predicateType must be"),
        (("predicate", "result"), "passed", "result must be PASSED or FAILED"),
        (("predicate", "result"), ["PASSED"], "result must be PASSED or FAILED"),
        (("predicate", "claims", 0, "evidence"), {"x": 1}, "evidence must be one of"),
        (("predicate", "issuedOn"), "2026-03-14T15:09:26.5Z", "RFC 3339 UTC time"),
        (("predicate", "claims", 0, "evidence"), "trust me", "evidence must be one of"),
        (("predicate", "claims", 0, "value"), float("nan"), "finite number"),
        (("predicate", "replay", "challengedSteps"), [3, 1], "strictly ascending"),
        (("predicate", "replay", "challengeSeed"), "5e", "challengeSeed must be 32 bytes"),
        (("predicate", "log", "index"), -1, r"log.index must be >= 0"),
        (("predicate", "log", "index"), True, r"log.index must be an integer"),
        (("predicate", "trustRoot", "version"), 0, "trustRoot.version must be >= 1"),
        (("predicate", "surprise"), 1, "unknown field 'surprise'"),
    ],
)
def test_malformed_statements_are_named(
    trust_root_v1: TrustRoot, make_certificate: Any, path: tuple[Any, ...], value: Any, message: str
) -> None:
    document = copy.deepcopy(_document(trust_root_v1, make_certificate))
    target = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(MalformedInputError, match=message):
        TrainingCertificate.from_statement(Statement.from_dict(document))


def test_missing_subject_is_named(trust_root_v1: TrustRoot, make_certificate: Any) -> None:
    document = _document(trust_root_v1, make_certificate)
    del document["subject"][1]
    with pytest.raises(MalformedInputError, match="no subject named 'zkdv/final-parameters'"):
        TrainingCertificate.from_statement(Statement.from_dict(document))
