"""The offline report bundle: every check of verify_bundle, key validity at signing
time across a rotation, and a flipped bit anywhere in a bundle."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvbench.attest import (
    BUNDLE_FORMAT,
    Checkpoint,
    SigningKey,
    TrustRoot,
    envelope_leaf,
    envelope_leaf_hash,
    leaf_hash,
    sign_checkpoint,
    verify_bundle,
    verify_certificate,
)
from dvbench.attest._encoding import canonical_json
from tests.synthetic import write_synthetic_transcript
from zkdv.verify import verify_transcript

NOW = datetime(2026, 11, 29, tzinfo=UTC)


def _verify(bundle: Any, trust_root: TrustRoot, **kwargs: Any) -> Any:
    return verify_bundle(bundle, trust_root, now=kwargs.pop("now", NOW), **kwargs)


def test_it_verifies(
    bundle: dict[str, Any], trust_root_v1: TrustRoot, key_2026a: SigningKey
) -> None:
    result = _verify(bundle, trust_root_v1)
    assert result.ok, result.message
    assert result.reason is None and result.message is None
    assert result.keyid == key_2026a.keyid
    assert result.certificate is not None and result.certificate.log.index == 3
    assert result.checkpoint is not None and result.checkpoint.tree_size == 5
    assert result.summary().startswith("verified: certificate PASSED issued 2026-03-14T15:09:26Z")
    json.dumps(result.to_dict())


def test_bundle_layout(bundle: dict[str, Any], trust_root_v1: TrustRoot) -> None:
    assert set(bundle) == {"format", "envelope", "inclusion_proof", "checkpoint", "trust_root"}
    assert bundle["format"] == BUNDLE_FORMAT
    assert set(bundle["inclusion_proof"]) == {"log_index", "tree_size", "hashes"}
    assert bundle["trust_root"] == trust_root_v1.to_dict()
    # The log leaf is the canonical JSON of the envelope, hashed as RFC 9162 leaves are.
    assert (
        envelope_leaf(bundle["envelope"])
        == json.dumps(bundle["envelope"], sort_keys=True, separators=(",", ":")).encode()
    )
    assert envelope_leaf_hash(bundle["envelope"]) == leaf_hash(envelope_leaf(bundle["envelope"]))


def test_it_accepts_json_bytes_and_text(bundle: dict[str, Any], trust_root_v1: TrustRoot) -> None:
    assert _verify(json.dumps(bundle, indent=2).encode(), trust_root_v1).ok
    assert _verify(json.dumps(bundle), trust_root_v1).ok
    result = _verify(b"{not json", trust_root_v1)
    assert (result.ok, result.reason) == (False, "malformed")
    assert "not valid JSON" in (result.message or "")


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"format": ' + "9" * 5000 + "}",
        '{"format": NaN}',
        '{"a": 1, "a": 1}',
        b"\xff\xfe",
    ],
    ids=["deep", "huge-integer", "nan", "duplicate-key", "not-utf8"],
)
def test_hostile_json_is_malformed_not_a_crash(text: str | bytes, trust_root_v1: TrustRoot) -> None:
    result = _verify(text, trust_root_v1)
    assert (result.ok, result.reason) == (False, "malformed")


def test_an_absurd_checkpoint_size_is_malformed(
    bundle: dict[str, Any], trust_root_v1: TrustRoot
) -> None:
    lines = bundle["checkpoint"].split("\n")
    lines[1] = "9" * 5000
    result = _verify(dict(bundle, checkpoint="\n".join(lines)), trust_root_v1)
    assert (result.ok, result.reason) == (False, "malformed")
    assert "below 2**64" in (result.message or "")


# --- keys and their validity windows ---------------------------------------------------


def test_a_certificate_survives_the_rotation_of_its_key(
    platform: Any, trust_root_v2: TrustRoot
) -> None:
    # Issued under v1 in March; the auditor holds v2, where 2026a ended on 2026-07-01.
    assert _verify(platform.issue(), trust_root_v2).ok


def test_a_retired_key_cannot_sign_after_its_window(
    platform: Any, trust_root_v2: TrustRoot
) -> None:
    platform.trust_root = trust_root_v2
    late = datetime(2026, 8, 1, tzinfo=UTC)
    result = _verify(platform.issue(issued_at=late), trust_root_v2)
    assert (result.ok, result.reason) == (False, "key_not_valid")
    assert "certificate signature by key" in (result.message or "")
    assert "2026-08-01T00:00:00Z, outside the key's validity window" in (result.message or "")


def test_a_new_key_cannot_sign_before_its_window(
    platform: Any, trust_root_v2: TrustRoot, key_2026b: SigningKey
) -> None:
    # A backdated certificate by the incoming key: its window only opens on 2026-07-01.
    platform.trust_root, platform.signer = trust_root_v2, key_2026b
    result = _verify(platform.issue(), trust_root_v2)
    assert (result.ok, result.reason) == (False, "key_not_valid")
    assert key_2026b.keyid in (result.message or "")


def test_the_checkpoint_key_is_judged_at_the_checkpoint_time(
    platform: Any, trust_root_v2: TrustRoot, key_2026a: SigningKey
) -> None:
    platform.trust_root = trust_root_v2
    late = datetime(2026, 8, 1, tzinfo=UTC)
    result = _verify(platform.issue(checkpoint_at=late, checkpoint_signer=key_2026a), trust_root_v2)
    assert (result.ok, result.reason) == (False, "key_not_valid")
    assert "checkpoint signature" in (result.message or "")


def test_a_key_outside_the_trust_root_is_refused(platform: Any, outsider_key: SigningKey) -> None:
    platform.signer = outsider_key
    result = _verify(platform.issue(), platform.trust_root)
    assert (result.ok, result.reason) == (False, "unknown_key")
    assert outsider_key.keyid in (result.message or "")


def test_the_auditors_trust_root_decides_not_the_bundles(
    bundle: dict[str, Any], key_2026b: SigningKey
) -> None:
    stranger = TrustRoot.initial(key_2026b.public_key, not_before=datetime(2026, 1, 1, tzinfo=UTC))
    result = _verify(bundle, stranger)
    assert (result.ok, result.reason) == (False, "unknown_key")


def test_the_bundle_trust_root_must_be_the_one_the_certificate_names(
    bundle: dict[str, Any], trust_root_v1: TrustRoot, trust_root_v2: TrustRoot
) -> None:
    swapped = dict(bundle, trust_root=trust_root_v2.to_dict())
    result = _verify(swapped, trust_root_v2)
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "is not the trust root the certificate was issued under (version 1" in (
        result.message or ""
    )


# --- the log --------------------------------------------------------------------------


def test_inclusion_must_prove_the_certificates_own_entry(
    platform: Any, trust_root_v1: TrustRoot
) -> None:
    first = platform.issue()
    second = platform.issue()
    # A fresh checkpoint covering both, with the second bundle's proof: wrong entry.
    mixed = dict(first, inclusion_proof=second["inclusion_proof"], checkpoint=second["checkpoint"])
    result = _verify(mixed, trust_root_v1)
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "inclusion proof is for log index 8, the certificate is entry 3" in (
        result.message or ""
    )
    # The right index but a proof from a smaller tree than the checkpoint's.
    stale = copy.deepcopy(first)
    stale["checkpoint"] = second["checkpoint"]
    result = _verify(stale, trust_root_v1)
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "tree size 5, the checkpoint for 10" in (result.message or "")


def test_a_proof_against_a_newer_checkpoint_verifies(
    platform: Any, trust_root_v1: TrustRoot
) -> None:
    bundle = platform.issue()
    platform.issue()
    index = bundle["inclusion_proof"]["log_index"]
    later = datetime(2026, 3, 15, tzinfo=UTC)
    bundle["checkpoint"] = sign_checkpoint(
        Checkpoint("dvbench.example/log", platform.log.size, platform.log.root(), later),
        platform.signer,
    )
    bundle["inclusion_proof"] = {
        "log_index": index,
        "tree_size": platform.log.size,
        "hashes": [value.hex() for value in platform.log.inclusion_proof(index)],
    }
    assert _verify(bundle, trust_root_v1).ok


def test_an_envelope_missing_from_the_log_fails(platform: Any, trust_root_v1: TrustRoot) -> None:
    bundle = platform.issue()
    # A validly signed certificate that was never appended: swap it in.
    index = bundle["inclusion_proof"]["log_index"]
    other = platform.issue()
    forged = dict(bundle, envelope=other["envelope"])
    result = _verify(forged, trust_root_v1)
    assert not result.ok
    # The other certificate names another index, so the mismatch is caught first.
    assert result.reason == "bundle_mismatch" and str(index) in (result.message or "")


def test_checkpoint_of_another_log_fails(platform: Any, trust_root_v1: TrustRoot) -> None:
    bundle = platform.issue()
    note = bundle["checkpoint"]
    size = bundle["inclusion_proof"]["tree_size"]
    other = sign_checkpoint(
        Checkpoint(
            "elsewhere.example/log",
            size,
            platform.log.root(size),
            datetime(2026, 3, 15, tzinfo=UTC),
        ),
        platform.signer,
    )
    assert note != other
    result = _verify(dict(bundle, checkpoint=other), trust_root_v1)
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "checkpoint is from log 'elsewhere.example/log'" in (result.message or "")


def test_time_order_is_checked(platform: Any, trust_root_v1: TrustRoot) -> None:
    early = platform.issue(checkpoint_at=datetime(2026, 3, 1, tzinfo=UTC))
    result = _verify(early, trust_root_v1)
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "after the checkpoint that includes it" in (result.message or "")
    result = _verify(platform.issue(), trust_root_v1, now=datetime(2026, 3, 14, tzinfo=UTC))
    assert (result.ok, result.reason) == (False, "bundle_mismatch")
    assert "is in the future" in (result.message or "")


# --- the transcript subject -------------------------------------------------------------


@pytest.fixture(scope="module")
def proof_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_transcript(tmp_path_factory.mktemp("proof"), steps=4)


def test_the_local_transcript_must_match_the_subject(
    platform: Any, trust_root_v1: TrustRoot, proof_dir: Path, tmp_path: Path
) -> None:
    report = verify_transcript(proof_dir)
    assert report.ok and report.digest and report.final
    bundle = platform.issue(transcript_digest=report.digest, final_parameter_root=report.final["p"])
    result = _verify(bundle, trust_root_v1, transcript_path=proof_dir)
    assert result.ok and result.transcript_checked, result.message
    assert "matches the local transcript" in result.summary()
    # Only the records file, without probes.bin beside it: still verifiable.
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "records.cborl").write_bytes((proof_dir / "records.cborl").read_bytes())
    assert _verify(bundle, trust_root_v1, transcript_path=alone / "records.cborl").ok

    other = write_synthetic_transcript(tmp_path / "other", steps=4, seed=1)
    result = _verify(bundle, trust_root_v1, transcript_path=other)
    assert (result.ok, result.reason) == (False, "subject_mismatch")
    assert f"the certificate's subject is {report.digest}" in (result.message or "")

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (proof_dir / "records.cborl").read_bytes()
    (truncated / "records.cborl").write_bytes(data[: len(data) // 2])
    result = _verify(bundle, trust_root_v1, transcript_path=truncated)
    assert (result.ok, result.reason) == (False, "subject_mismatch")
    assert "does not verify" in (result.message or "")

    # A path that names nothing is the command's mistake, said as such, not a mismatch.
    result = _verify(bundle, trust_root_v1, transcript_path=tmp_path / "absent")
    assert (result.ok, result.reason) == (False, "malformed")
    assert "cannot read transcript" in (result.message or "")
    assert "no such file or directory" in (result.message or "")


# --- a flipped bit anywhere -------------------------------------------------------------


def _flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


@pytest.fixture
def canonical_bundle(platform: Any, trust_root_v1: TrustRoot) -> tuple[bytes, TrustRoot]:
    """One bundle as canonical JSON bytes, and the trust root that accepts it.

    Built once per test; hypothesis' examples only read it.
    """
    data = canonical_json(platform.issue())
    assert verify_bundle(data, trust_root_v1, now=NOW).ok
    return data, trust_root_v1


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_a_flipped_bit_anywhere_fails(
    canonical_bundle: tuple[bytes, TrustRoot], data: st.DataObject
) -> None:
    raw, root = canonical_bundle
    bit = data.draw(st.integers(0, len(raw) * 8 - 1), label="bit")
    result = verify_bundle(_flip(raw, bit), root, now=NOW)
    assert not result.ok, f"bit {bit} (byte {bit // 8}: {raw[bit // 8 - 20 : bit // 8 + 20]!r})"


@pytest.mark.slow
def test_every_single_bit_flip_fails(canonical_bundle: tuple[bytes, TrustRoot]) -> None:
    # Exhaustive companion of the property above: all len * 8 flips (some seconds).
    raw, root = canonical_bundle
    survivors = [
        bit for bit in range(len(raw) * 8) if verify_bundle(_flip(raw, bit), root, now=NOW).ok
    ]
    assert survivors == []


def test_verify_certificate_alone(bundle: dict[str, Any], trust_root_v1: TrustRoot) -> None:
    certificate = verify_certificate(bundle["envelope"], trust_root_v1)
    assert certificate.issued_at == datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)
    assert certificate.issued_at + timedelta(0) < NOW
