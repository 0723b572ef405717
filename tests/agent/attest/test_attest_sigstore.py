"""The certificate as a Sigstore bundle v0.3, checked by our verifier and by tools we did not write.

What Sigstore's own Python tools can and cannot do with it is pinned here, so that a
release of theirs that changes either shows up as a failing test:

* ``sigstore`` (sigstore-python) refuses any bundle without a Fulcio certificate:
  ``Bundle.from_json`` raises ``InvalidBundle("expected certificate in bundle")``; it has
  no key-based verification. Its transparency-log code does verify our log entry: the
  RFC 6962 inclusion proof from ``canonicalizedBody`` and the signed checkpoint, with the
  platform's Ed25519 key in a Rekor keyring.
* ``model_signing``'s key-based verifier takes elliptic-curve keys only
  (P-256/384/521), so it refuses the platform's Ed25519 key; it also verifies only its
  own predicate (``https://model_signing/signature/v1.0``), not a training certificate.
* ``sigstore_models`` (Sigstore's protobuf-specs models) parses the bundle, and
  ``securesystemslib`` verifies its DSSE envelope with the trust root's key, as does
  ``openssl pkeyutl`` over the DSSE pre-authentication encoding.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from dvbench.attest import (
    SIGSTORE_BUNDLE_MEDIA_TYPE,
    Checkpoint,
    Claim,
    Evidence,
    LogEntryRef,
    MerkleTree,
    ReplayEvidence,
    Result,
    SigningKey,
    TrainingCertificate,
    TrustRoot,
    envelope_leaf_hash,
    make_sigstore_bundle,
    note_key_id,
    note_verifier_key,
    pae,
    parse_note_verifier_key,
    sign_certificate,
    sign_checkpoint,
    verify_bundle,
)

ORIGIN = "dvbench.example/log"
START = datetime(2026, 3, 1, tzinfo=UTC)
ISSUED = datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)


def _certificate(index: int, trust_root: TrustRoot) -> TrainingCertificate:
    return TrainingCertificate(
        transcript_digest=f"{index:02x}" * 32,
        final_parameter_root="9a" * 32,
        verifier_id="https://dvbench.example",
        verifier_version="0.1.0",
        issued_at=ISSUED,
        policy_digest="e3" * 32,
        result=Result.PASSED,
        claims=(Claim("flops", 3.25e18, Evidence.REPLAYED, "FLOP"),),
        replay=ReplayEvidence("5e" * 32, (0, 3), {"abs": 1e-06, "rel": 0.001}),
        log=LogEntryRef(ORIGIN, index),
        trust_root_version=trust_root.version,
        trust_root_digest=trust_root.digest(),
        experiment="acme/run-7",
    )


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def trust_root(key: SigningKey) -> TrustRoot:
    return TrustRoot.initial(key.public_key, not_before=START, log_origin=ORIGIN)


@pytest.fixture(scope="module")
def bundle(key: SigningKey, trust_root: TrustRoot) -> dict[str, Any]:
    """Entry 5 of a log of 7 certificates: an inclusion proof with several hashes."""
    tree = MerkleTree()
    envelopes = []
    for index in range(7):
        envelope = sign_certificate(_certificate(index, trust_root), key)
        envelopes.append(envelope)
        tree.append(envelope_leaf_hash(envelope))
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, tree.root(), ISSUED + timedelta(seconds=2)), key)
    return make_sigstore_bundle(
        envelopes[5],
        log_index=5,
        inclusion_proof=tree.inclusion_proof(5, 7),
        checkpoint=note,
        public_key=key.public_key,
    )


def test_our_verifier_accepts_it(bundle: dict[str, Any], trust_root: TrustRoot) -> None:
    result = verify_bundle(json.dumps(bundle), trust_root)
    assert result.ok, result.summary()
    assert result.certificate is not None and result.certificate.log.index == 5
    assert bundle["mediaType"] == SIGSTORE_BUNDLE_MEDIA_TYPE


@pytest.mark.parametrize(
    ("change", "reason", "words"),
    [
        (lambda b: b["verificationMaterial"]["publicKey"].update(hint="ab" * 32), "bundle_mismatch", "hint"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["logId"].update(keyId=base64.b64encode(b"x" * 32).decode()), "bundle_mismatch", "logId"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(integratedTime="1"), "bundle_mismatch", "integratedTime"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(logIndex="4"), "bundle_mismatch", "index"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(canonicalizedBody=base64.b64encode(b"{}").decode()), "bundle_mismatch", "canonicalizedBody"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["hashes"].pop(), "bad_proof", "inclusion proof"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["kindVersion"].update(kind="dsse"), "malformed", "kindVersion"),
        (lambda b: b.update(mediaType="application/vnd.dev.sigstore.bundle+json;version=0.2"), "malformed", "mediaType"),
        (lambda b: b["verificationMaterial"]["tlogEntries"].append({}), "malformed", "one entry"),
        (lambda b: b["dsseEnvelope"]["signatures"][0].update(sig=base64.b64encode(b"\0" * 64).decode()), "bad_signature", "does not verify"),
    ],
)  # fmt: skip
def test_each_inconsistency_is_rejected_with_its_reason(
    bundle: dict[str, Any], trust_root: TrustRoot, change: Any, reason: str, words: str
) -> None:
    tampered = copy.deepcopy(bundle)
    change(tampered)
    result = verify_bundle(tampered, trust_root)
    assert not result.ok and result.reason == reason, result.summary()
    assert words in (result.message or ""), result.message


def test_every_flipped_byte_is_rejected(bundle: dict[str, Any], trust_root: TrustRoot) -> None:
    # Two bits of every byte (the report bundle's test flips all eight; this keeps CI fast):
    # bit 0 turns each digit, letter and base64 character into another, bit 5 flips case.
    text = json.dumps(bundle, sort_keys=True, separators=(",", ":")).encode()
    assert verify_bundle(text, trust_root).ok
    accepted = []
    for position in range(len(text)):
        for bit in (0, 5):
            flipped = bytearray(text)
            flipped[position] ^= 1 << bit
            if verify_bundle(bytes(flipped), trust_root).ok:
                accepted.append((position, bit))
    assert accepted == []


# --- tools we did not write ---------------------------------------------------------------


def test_sigstore_models_parses_it_as_a_v0_3_bundle(bundle: dict[str, Any]) -> None:
    from sigstore_models.bundle.v1 import Bundle

    parsed = Bundle.from_json(json.dumps(bundle))
    assert parsed.media_type == SIGSTORE_BUNDLE_MEDIA_TYPE
    entry = parsed.verification_material.tlog_entries[0]
    assert entry.log_index == 5 and entry.inclusion_proof.tree_size == 7


def _rekor_keyring(key: SigningKey) -> Any:
    from sigstore._internal.trust import Keyring, RekorKeyring
    from sigstore_models.common.v1 import PublicKey, PublicKeyDetails

    der = key.public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return RekorKeyring(
        Keyring(
            [PublicKey(raw_bytes=base64.b64encode(der), key_details=PublicKeyDetails.PKIX_ED25519)]
        )
    )


def _sigstore_entry(bundle: dict[str, Any]) -> Any:
    from sigstore.models import TransparencyLogEntry
    from sigstore_models.rekor.v1 import TransparencyLogEntry as Entry

    raw = bundle["verificationMaterial"]["tlogEntries"][0]
    return TransparencyLogEntry(Entry.from_json(json.dumps(raw)))


def test_sigstore_python_verifies_the_log_entry(bundle: dict[str, Any], key: SigningKey) -> None:
    """sigstore-python's RFC 6962 inclusion and signed-checkpoint checks accept the entry."""
    _sigstore_entry(bundle)._verify(_rekor_keyring(key))


def test_sigstore_python_rejects_a_tampered_log_entry(
    bundle: dict[str, Any], key: SigningKey
) -> None:
    from sigstore.errors import VerificationError

    for path, value in (
        (("canonicalizedBody",), base64.b64encode(b'{"payload":""}').decode()),
        (("inclusionProof", "rootHash"), base64.b64encode(b"\1" * 32).decode()),
    ):
        tampered = copy.deepcopy(bundle)
        target = tampered["verificationMaterial"]["tlogEntries"][0]
        for name in path[:-1]:
            target = target[name]
        target[path[-1]] = value
        with pytest.raises(VerificationError):
            _sigstore_entry(tampered)._verify(_rekor_keyring(key))
    other = SigningKey.generate()
    with pytest.raises(VerificationError):
        _sigstore_entry(bundle)._verify(_rekor_keyring(other))


def test_sigstore_python_has_no_key_based_bundle_verification(bundle: dict[str, Any]) -> None:
    """Pinned: sigstore-python requires a Fulcio certificate; docs/certificates.md says why."""
    from sigstore.errors import Error
    from sigstore.models import Bundle

    with pytest.raises(Error, match="expected certificate in bundle"):
        Bundle.from_json(json.dumps(bundle))


def test_model_signing_key_verification_takes_no_ed25519_key(
    key: SigningKey, tmp_path: Path
) -> None:
    """Pinned: model_signing's key-based verifier supports ECDSA P-256/384/521 only."""
    import model_signing

    public = tmp_path / "platform.pub"
    public.write_text(key.public_pem)
    with pytest.raises((ValueError, AttributeError), match=r"curve|elliptic"):
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public)


def test_securesystemslib_verifies_the_envelope(bundle: dict[str, Any], key: SigningKey) -> None:
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    verifier = SSlibKey.from_crypto(key.public_key, keyid=key.keyid)
    envelope = Envelope.from_dict(copy.deepcopy(bundle["dsseEnvelope"]))  # it consumes the dict
    assert key.keyid in envelope.verify([verifier], 1)
    assert bundle["verificationMaterial"]["publicKey"]["hint"] == key.keyid


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_openssl_verifies_the_envelope_signature(
    bundle: dict[str, Any], key: SigningKey, tmp_path: Path
) -> None:
    envelope = bundle["dsseEnvelope"]
    (tmp_path / "pae.bin").write_bytes(
        pae(envelope["payloadType"], base64.b64decode(envelope["payload"]))
    )
    (tmp_path / "sig.bin").write_bytes(base64.b64decode(envelope["signatures"][0]["sig"]))
    (tmp_path / "key.pem").write_text(key.public_pem)
    command = ["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", "key.pem", "-rawin"]
    command += ["-in", "pae.bin", "-sigfile", "sig.bin"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Signature Verified Successfully" in done.stdout, done
    (tmp_path / "pae.bin").write_bytes(b"x" + (tmp_path / "pae.bin").read_bytes())
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode != 0


# --- the log key in signed-note format ------------------------------------------------------


def test_the_verifier_key_is_signed_notes_format(key: SigningKey, bundle: dict[str, Any]) -> None:
    vkey = note_verifier_key(ORIGIN, key.public_key)
    name, key_hash, encoded = vkey.split("+", 2)
    raw = key.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert name == ORIGIN
    assert base64.b64decode(encoded) == b"\x01" + raw
    assert key_hash == note_key_id(ORIGIN, key.public_key)[:4].hex()
    # The checkpoint's signature line starts with that key hash; logId is the whole ID.
    note = bundle["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["checkpoint"]
    line = note["envelope"].split("\n\n")[1]
    assert base64.b64decode(line.split()[-1])[:4].hex() == key_hash
    log_id = bundle["verificationMaterial"]["tlogEntries"][0]["logId"]["keyId"]
    assert base64.b64decode(log_id) == note_key_id(ORIGIN, key.public_key)
    assert parse_note_verifier_key(vkey)[0] == ORIGIN


def test_the_trust_root_carries_verifier_keys_and_refuses_wrong_ones(
    trust_root: TrustRoot, key: SigningKey
) -> None:
    document = trust_root.to_dict()
    assert document["keys"][0]["note_verifier_key"] == note_verifier_key(ORIGIN, key.public_key)
    assert TrustRoot.from_dict(document) == trust_root
    other = SigningKey.generate()
    wrong = copy.deepcopy(document)
    wrong["keys"][0]["note_verifier_key"] = note_verifier_key(ORIGIN, other.public_key)
    with pytest.raises(ValueError, match="another key"):
        TrustRoot.from_dict(wrong)
    forged_hash = copy.deepcopy(document)
    name, _, encoded = document["keys"][0]["note_verifier_key"].split("+", 2)
    forged_hash["keys"][0]["note_verifier_key"] = f"{name}+00000000+{encoded}"
    with pytest.raises(ValueError, match="key hash"):
        TrustRoot.from_dict(forged_hash)
    # A trust root published before verifier keys existed still reads.
    legacy = TrustRoot(version=1, keys=trust_root.keys)
    assert "note_verifier_key" not in legacy.to_dict()["keys"][0]
    assert TrustRoot.from_dict(legacy.to_dict()).log_origin is None
    assert legacy.with_log_origin(ORIGIN).version == 2
