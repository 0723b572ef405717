"""The transparency log through the platform: proofs for every tree size, and altered rows found."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from rest_framework.test import APIClient

from attestations.certificates import issuance, keys, translog
from attestations.certificates.models import Certificate, LogCheckpoint, LogEntry
from attestations.proofs.models import Proof
from dvbench.attest import (
    InvalidProofError,
    TrustRoot,
    leaf_hash,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from tests.attestations.base import World, error_of
from tests.attestations.certificate_helpers import certify, declare_sgd, finalize

#: Past 128, so sizes on both sides of several powers of two are covered (each
#: certificate is issued through the service: signed and timestamped, about 0.1 s).
LOG_SIZE = 130
Api = Callable[[str | None], APIClient]


def _issue_many(world: World, count: int) -> list[Certificate]:
    """``count`` certificates of fresh proofs of acme/run-1, through the service."""
    declare_sgd(world.experiment)
    template = finalize(world.proof)
    proofs = Proof.objects.bulk_create(
        Proof(
            experiment=template.experiment,
            spec=template.spec,
            transcript=template.transcript,
            status=template.status,
            report=template.report,
            transcript_digest=template.transcript_digest,
            steps=template.steps,
            checks=template.checks,
        )
        for _ in range(count)
    )
    return [issuance.issue_certificate(proof.pk) for proof in proofs]


@pytest.fixture
def big_log(world: World) -> list[Certificate]:
    # Built through the service (no mocks): a proof row each, a certificate each.
    return _issue_many(world, LOG_SIZE)


def _unhex(values: list[str]) -> list[bytes]:
    return [bytes.fromhex(value) for value in values]


def _check_every_inclusion_proof() -> None:
    leaves = [
        leaf_hash(entry.leaf.encode()) for entry in LogEntry.objects.order_by("index").iterator()
    ]
    assert len(leaves) == LOG_SIZE
    with translog._TREE.lock:
        tree = translog._TREE.synced()
    for size in range(1, LOG_SIZE + 1):
        root = tree.root(size)
        assert root.hex() == LogCheckpoint.objects.get(tree_size=size).root_hash
        for index in range(size):
            verify_inclusion(leaves[index], index, size, tree.inclusion_proof(index, size), root)


def test_every_tree_size_proves_inclusion_and_consistency(
    big_log: list[Certificate], api: Api
) -> None:
    # Every entry at every size, on the tree the service rebuilds from the stored rows
    # (one build, so a few hundred squared proofs stay cheap) ...
    _check_every_inclusion_proof()
    # ... and through the public API, for every size: the newest entry and a random one,
    # and a consistency proof from a random earlier size, against the signed checkpoints.
    anonymous = api(None)  # the log's proofs are public
    trust_root = TrustRoot.from_json(anonymous.get("/api/v1/trust-root/").content)
    leaves = dict(LogEntry.objects.values_list("index", "leaf_hash"))
    chooser = random.Random(9162)
    for size in range(1, LOG_SIZE + 1):
        for index in {size - 1, chooser.randrange(size)}:
            body = anonymous.get(
                "/api/v1/log/proof/inclusion/", {"index": index, "tree_size": size}
            ).json()
            checkpoint = verify_checkpoint(body["checkpoint"], trust_root)
            assert (checkpoint.tree_size, checkpoint.root_hash.hex()) == (size, body["root_hash"])
            assert body["leaf_hash"] == leaves[index]
            verify_inclusion(
                bytes.fromhex(leaves[index]),
                index,
                size,
                _unhex(body["hashes"]),
                checkpoint.root_hash,
            )
        first = chooser.randrange(size + 1)
        body = anonymous.get(
            "/api/v1/log/proof/consistency/", {"first": first, "second": size}
        ).json()
        new = verify_checkpoint(body["second_checkpoint"], trust_root)
        old_root = (
            verify_checkpoint(body["first_checkpoint"], trust_root).root_hash
            if first
            else bytes.fromhex(body["first_root"])
        )
        verify_consistency(first, size, old_root, new.root_hash, _unhex(body["hashes"]))


@pytest.fixture
def small_log(world: World) -> list[Certificate]:
    return _issue_many(world, 11)


def _tampered(hashes: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    for position in range(len(hashes)):
        changed = list(hashes)
        changed[position] = bytes([changed[position][0] ^ 1]) + changed[position][1:]
        yield f"hash {position} altered", changed
    yield "last hash dropped", hashes[:-1]
    yield "a hash added", [*hashes, hashes[0]]
    if len(hashes) > 1:
        yield "hashes swapped", [hashes[1], hashes[0], *hashes[2:]]


def test_altered_proofs_from_the_api_fail(small_log: list[Certificate], api: Api) -> None:
    client = api(None)
    latest = client.get("/api/v1/log/checkpoint/").json()
    root = bytes.fromhex(latest["root_hash"])
    size = latest["tree_size"]
    assert size == 11
    body = client.get("/api/v1/log/proof/inclusion/", {"index": 5}).json()
    leaf = bytes.fromhex(body["leaf_hash"])
    hashes = _unhex(body["hashes"])
    verify_inclusion(leaf, 5, size, hashes, root)
    for what, changed in _tampered(hashes):
        with pytest.raises(InvalidProofError):
            verify_inclusion(leaf, 5, size, changed, root)
            pytest.fail(f"an inclusion proof with {what} verified")
    for index in (4, 6):
        with pytest.raises(InvalidProofError):
            verify_inclusion(leaf, index, size, hashes, root)

    body = client.get("/api/v1/log/proof/consistency/", {"first": 6, "second": 11}).json()
    old = bytes.fromhex(body["first_root"])
    hashes = _unhex(body["hashes"])
    verify_consistency(6, 11, old, root, hashes)
    for what, changed in _tampered(hashes):
        with pytest.raises(InvalidProofError):
            verify_consistency(6, 11, old, root, changed)
            pytest.fail(f"a consistency proof with {what} verified")
    with pytest.raises(InvalidProofError):
        verify_consistency(5, 11, old, root, hashes)


@pytest.mark.parametrize(
    ("query", "field", "status"),
    [
        ({"tree_size": 3}, "index", 400),
        ({"index": "x"}, "index", 400),
        ({"index": ""}, "index", 400),
        ({"index": 2**63}, "index", 400),
        # Well formed, but the log has no such leaf or tree size (yet): not found.
        ({"index": 11}, "index", 404),
        ({"index": 2, "tree_size": 12}, "tree_size", 404),
        ({"index": 3, "tree_size": 3}, "index", 404),
    ],
)
def test_a_bad_inclusion_query_names_the_parameter(
    small_log: list[Certificate], api: Api, query: dict[str, Any], field: str, status: int
) -> None:
    response = api(None).get("/api/v1/log/proof/inclusion/", query)
    assert response.status_code == status, response.content
    assert error_of(response)["field"] == field


@pytest.mark.parametrize(
    ("query", "field", "status"),
    [
        ({"first": 2}, "second", 400),
        ({"first": -1, "second": 3}, "first", 400),
        ({"first": 5, "second": 3}, "first", 404),
        ({"first": 1, "second": 12}, "second", 404),
    ],
)
def test_a_bad_consistency_query_names_the_parameter(
    small_log: list[Certificate], api: Api, query: dict[str, Any], field: str, status: int
) -> None:
    response = api(None).get("/api/v1/log/proof/consistency/", query)
    assert response.status_code == status, response.content
    assert error_of(response)["field"] == field


def test_an_empty_log_has_no_checkpoint(world: World, api: Api) -> None:
    response = api(None).get("/api/v1/log/checkpoint/")
    assert response.status_code == 404
    assert "empty" in error_of(response)["message"]


# --- verify_log ---------------------------------------------------------------------


def _raw(sql: str, params: list[Any]) -> None:
    """Change rows behind the model's back (and, on PostgreSQL, behind its trigger).

    On PostgreSQL the session's replication role turns user triggers off for the one
    statement, as an attacker with superuser access could.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(sql, params)
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL session_replication_role = origin")


def _verify_log_fails() -> str:
    from io import StringIO

    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="log verification failed"):
        call_command("verify_log", stdout=out, stderr=err)
    return err.getvalue()


def test_verify_log_passes_on_an_untouched_log(small_log: list[Certificate]) -> None:
    from io import StringIO

    out = StringIO()
    call_command("verify_log", stdout=out)
    assert "log verified: 11 log entries, 11 checkpoints, 1 trust root versions" in out.getvalue()


def test_log_entries_are_rekor_dsse_entries_of_their_envelopes(
    small_log: list[Certificate],
) -> None:
    from dvbench.attest import DSSE_KIND, dsse_entry_body, leaf_hash

    for certificate in small_log:
        entry = certificate.log_entry
        assert entry.kind == DSSE_KIND and entry.inclusion_promise and entry.rfc3161_timestamp
        root = keys.current_trust_root().trust_root()
        key = root.key(entry.envelope["signatures"][0]["keyid"])
        assert entry.leaf.encode() == dsse_entry_body(entry.envelope, key.public_key)
        assert leaf_hash(entry.leaf.encode()).hex() == entry.leaf_hash


def test_verify_log_finds_an_altered_envelope(small_log: list[Certificate]) -> None:
    entry = LogEntry.objects.get(index=4)
    altered = entry.envelope_json.replace('"payloadType"', '"payloadtype"')
    _raw("UPDATE attestations_logentry SET envelope_json = %s WHERE id = %s", [altered, entry.pk])
    problems = _verify_log_fails()
    assert "log entry 4: the envelope does not verify" in problems


def test_verify_log_finds_an_envelope_that_is_not_the_leafs(small_log: list[Certificate]) -> None:
    # A validly signed envelope, but another entry's: the leaf does not name it.
    other = LogEntry.objects.get(index=3)
    entry = LogEntry.objects.get(index=4)
    _raw(
        "UPDATE attestations_logentry SET envelope_json = %s WHERE id = %s",
        [other.envelope_json, entry.pk],
    )
    problems = _verify_log_fails()
    assert "log entry 4: the certificate names entry 3" in problems
    assert "log entry 4: the stored leaf is not the dsse entry of the stored envelope" in problems


def test_verify_log_finds_an_altered_leaf(small_log: list[Certificate]) -> None:
    entry = LogEntry.objects.get(index=4)
    altered = entry.leaf.replace(
        '"payloadHash":{"algorithm":"sha256","value":"',
        '"payloadHash":{"algorithm":"sha256","value":"0',
    )
    _raw("UPDATE attestations_logentry SET leaf = %s WHERE id = %s", [altered, entry.pk])
    problems = _verify_log_fails()
    assert "log entry 4: the stored leaf hash" in problems
    assert "log entry 4: the stored leaf is not the dsse entry" in problems
    # Every checkpoint from size 5 on covers the altered entry; the earlier ones do not.
    assert "checkpoint at size 5: the root recomputed" in problems
    assert "checkpoint at size 4:" not in problems


def test_verify_log_finds_an_altered_signed_entry_timestamp(small_log: list[Certificate]) -> None:
    entry = LogEntry.objects.get(index=2)
    forged = base64.b64encode(b"\0" * 64).decode()
    _raw(
        "UPDATE attestations_logentry SET inclusion_promise = %s WHERE id = %s", [forged, entry.pk]
    )
    assert "log entry 2: signed entry timestamp by key" in _verify_log_fails()


def test_verify_log_finds_an_altered_leaf_hash(small_log: list[Certificate]) -> None:
    _raw('UPDATE attestations_logentry SET leaf_hash = %s WHERE "index" = %s', ["00" * 32, 7])
    assert "log entry 7: the stored leaf hash" in _verify_log_fails()


def test_verify_log_finds_an_altered_certificate_row(small_log: list[Certificate]) -> None:
    _raw(
        "UPDATE attestations_certificate SET result = 'FAILED', flops = 1 WHERE id = %s",
        [small_log[2].pk],
    )
    problems = _verify_log_fails()
    assert "log entry 2: certificate" in problems
    assert "result='FAILED'" in problems and "flops=" in problems


def test_verify_log_finds_a_removed_entry_and_a_forged_checkpoint(
    small_log: list[Certificate],
) -> None:
    _raw(
        "UPDATE attestations_logcheckpoint SET note = %s WHERE tree_size = %s",
        [
            LogCheckpoint.objects.get(tree_size=3).note.replace("\n3\n", "\n4\n"),
            3,
        ],
    )
    problems = _verify_log_fails()
    assert "checkpoint at size 3: the signed note does not verify" in problems


def test_certificate_issued_after_a_rolled_back_append_is_consistent(world: World) -> None:
    # A failed issuance leaves nothing behind, and the next one reuses the index.
    certify(world.proof)
    declare_sgd(world.experiment)
    second = Proof.objects.create(
        experiment=world.experiment,
        spec=world.experiment.current_spec,
        transcript=world.proof.transcript,
    )
    with pytest.raises(issuance.CertificateNotIssuableError):
        issuance.issue_certificate(second.pk)  # still pending
    finalize(second)
    certificate = issuance.issue_certificate(second.pk)
    assert certificate.log_index == 1
    report = translog.verify_log()
    assert report.ok, report.problems


def test_verify_log_finds_a_key_window_nobody_published(small_log: list[Certificate]) -> None:
    from attestations.certificates.models import PlatformKey

    PlatformKey.objects.update(not_after=datetime(2027, 1, 1, tzinfo=UTC))
    problems = _verify_log_fails()
    assert "the key table and trust root version 1 disagree" in problems
