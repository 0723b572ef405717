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

from attestations.certificates.tsa import Authority, generate_authority
from dvbench.attest import (
    DSSE_KIND,
    LEGACY_KIND,
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
    dsse_entry_body,
    envelope_leaf_hash,
    inclusion_promise_payload,
    leaf_hash,
    make_sigstore_bundle,
    note_key_id,
    note_verifier_key,
    pae,
    parse_note_verifier_key,
    sign_certificate,
    sign_checkpoint,
    sigstore_trusted_root,
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
def authority() -> Authority:
    """A timestamp authority as the platform generates it (attestations/certificates/tsa.py)."""
    return generate_authority(START)


@pytest.fixture(scope="module")
def sigstore_root(trust_root: TrustRoot, authority: Authority) -> TrustRoot:
    """The auditor's trust root read from the Sigstore trusted_root.json: it lists the TSA."""
    document = sigstore_trusted_root(
        trust_root, log_origin=ORIGIN, timestamp_authorities=[authority.descriptor()]
    )
    return TrustRoot.from_json(json.dumps(document))


def _log_bundle(key: SigningKey, authority: Authority | None, *, legacy: bool) -> dict[str, Any]:
    """Entry 5 of a log of 7 certificates: an inclusion proof with several hashes."""
    tree = MerkleTree()
    envelopes = []
    for index in range(7):
        envelope = sign_certificate(_certificate(index, trust_root_of(key)), key)
        envelopes.append(envelope)
        if legacy:
            tree.append(envelope_leaf_hash(envelope))
        else:
            tree.append(leaf_hash(dsse_entry_body(envelope, key.public_key)))
    checkpoint_time = ISSUED + timedelta(seconds=2)
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, tree.root(), checkpoint_time), key)
    if legacy:
        return make_sigstore_bundle(
            envelopes[5],
            log_index=5,
            inclusion_proof=tree.inclusion_proof(5, 7),
            checkpoint=note,
            public_key=key.public_key,
            kind=LEGACY_KIND,
        )
    body = dsse_entry_body(envelopes[5], key.public_key)
    promise = key.sign(
        inclusion_promise_payload(
            body,
            integrated_time=int(checkpoint_time.timestamp()),
            log_index=5,
            log_id=note_key_id(ORIGIN, key.public_key),
        )
    )
    assert authority is not None
    token = authority.stamp(base64.b64decode(envelopes[5]["signatures"][0]["sig"]), ISSUED)
    return make_sigstore_bundle(
        envelopes[5],
        log_index=5,
        inclusion_proof=tree.inclusion_proof(5, 7),
        checkpoint=note,
        public_key=key.public_key,
        inclusion_promise=promise,
        timestamps=[token],
    )


_ROOTS: dict[str, TrustRoot] = {}


def trust_root_of(key: SigningKey) -> TrustRoot:
    if key.keyid not in _ROOTS:
        _ROOTS[key.keyid] = TrustRoot.initial(key.public_key, not_before=START, log_origin=ORIGIN)
    return _ROOTS[key.keyid]


@pytest.fixture(scope="module")
def bundle(key: SigningKey, trust_root: TrustRoot, authority: Authority) -> dict[str, Any]:
    _ROOTS[key.keyid] = trust_root
    return _log_bundle(key, authority, legacy=False)


@pytest.fixture(scope="module")
def legacy_bundle(key: SigningKey, trust_root: TrustRoot) -> dict[str, Any]:
    """A bundle of an entry logged before the dsse kind: the envelope is the leaf."""
    _ROOTS[key.keyid] = trust_root
    return _log_bundle(key, None, legacy=True)


def test_our_verifier_accepts_it(
    bundle: dict[str, Any], trust_root: TrustRoot, sigstore_root: TrustRoot
) -> None:
    for root in (trust_root, sigstore_root):
        result = verify_bundle(json.dumps(bundle), root)
        assert result.ok, result.summary()
        assert result.certificate is not None and result.certificate.log.index == 5
    assert bundle["mediaType"] == SIGSTORE_BUNDLE_MEDIA_TYPE
    entry = bundle["verificationMaterial"]["tlogEntries"][0]
    assert entry["kindVersion"] == DSSE_KIND
    assert set(entry) >= {"inclusionPromise", "inclusionProof", "canonicalizedBody"}


def test_the_log_body_is_the_rekor_dsse_entry_of_the_envelope(
    bundle: dict[str, Any], key: SigningKey
) -> None:
    """Rekor's dsse 0.0.1 body, recomputed from the envelope: hashes, signature, verifier."""
    import hashlib

    envelope = bundle["dsseEnvelope"]
    body = json.loads(
        base64.b64decode(bundle["verificationMaterial"]["tlogEntries"][0]["canonicalizedBody"])
    )
    canonical = json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()
    assert body == {
        "apiVersion": "0.0.1",
        "kind": "dsse",
        "spec": {
            "envelopeHash": {"algorithm": "sha256", "value": hashlib.sha256(canonical).hexdigest()},
            "payloadHash": {
                "algorithm": "sha256",
                "value": hashlib.sha256(base64.b64decode(envelope["payload"])).hexdigest(),
            },
            "signatures": [
                {
                    "signature": envelope["signatures"][0]["sig"],
                    "verifier": base64.b64encode(key.public_pem.encode()).decode(),
                }
            ],
        },
    }
    # rekor-types (sigstore-python's Rekor models) reads it as a dsse entry.
    from rekor_types import Dsse

    Dsse.model_validate(body)


def test_entries_logged_before_the_dsse_kind_still_verify(
    legacy_bundle: dict[str, Any], trust_root: TrustRoot
) -> None:
    entry = legacy_bundle["verificationMaterial"]["tlogEntries"][0]
    assert entry["kindVersion"] == LEGACY_KIND and "inclusionPromise" not in entry
    result = verify_bundle(legacy_bundle, trust_root)
    assert result.ok, result.summary()
    # Relabelled as dsse, the old leaf is not the dsse body of its envelope.
    relabelled = copy.deepcopy(legacy_bundle)
    relabelled["verificationMaterial"]["tlogEntries"][0]["kindVersion"] = dict(DSSE_KIND)
    result = verify_bundle(relabelled, trust_root)
    assert result.reason == "bundle_mismatch" and "canonicalizedBody" in (result.message or "")


def _entry(b: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = b["verificationMaterial"]["tlogEntries"][0]
    return entry


def _flip_token(b: dict[str, Any]) -> None:
    stamps = b["verificationMaterial"]["timestampVerificationData"]["rfc3161Timestamps"]
    token = bytearray(base64.b64decode(stamps[0]["signedTimestamp"]))
    token[-5] ^= 1  # inside the ECDSA signature
    stamps[0]["signedTimestamp"] = base64.b64encode(bytes(token)).decode()


@pytest.mark.parametrize(
    ("change", "reason", "words"),
    [
        (lambda b: _entry(b)["inclusionPromise"].update(signedEntryTimestamp=base64.b64encode(b"\0" * 64).decode()), "bad_signature", "inclusionPromise"),
        (_flip_token, "bad_signature", "rfc3161Timestamps[0]"),
        (lambda b: b["verificationMaterial"]["timestampVerificationData"]["rfc3161Timestamps"][0].update(signedTimestamp=base64.b64encode(b"0").decode()), "malformed", "RFC 3161"),
    ],
)  # fmt: skip
def test_signed_times_are_checked(
    bundle: dict[str, Any], sigstore_root: TrustRoot, change: Any, reason: str, words: str
) -> None:
    tampered = copy.deepcopy(bundle)
    change(tampered)
    result = verify_bundle(tampered, sigstore_root)
    assert not result.ok and result.reason == reason, result.summary()
    assert words in (result.message or ""), result.message


def test_the_sigstore_trusted_root_round_trips(
    trust_root: TrustRoot, sigstore_root: TrustRoot, authority: Authority
) -> None:
    assert sigstore_root.log_origin == ORIGIN
    assert [k.public_key for k in sigstore_root.keys] == [k.public_key for k in trust_root.keys]
    assert [k.not_before for k in sigstore_root.keys] == [k.not_before for k in trust_root.keys]
    assert sigstore_root.timestamp_authorities[0].chain == authority.chain
    # Sigstore's own models read it as a TrustedRoot.
    from sigstore_models.trustroot.v1 import TrustedRoot

    document = sigstore_trusted_root(
        trust_root, log_origin=ORIGIN, timestamp_authorities=[authority.descriptor()]
    )
    parsed = TrustedRoot.from_json(json.dumps(document))
    assert len(parsed.tlogs) == 1 and len(parsed.timestamp_authorities) == 1


@pytest.mark.parametrize(
    ("change", "reason", "words"),
    [
        (lambda b: b["verificationMaterial"]["publicKey"].update(hint="ab" * 32), "bundle_mismatch", "hint"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["logId"].update(keyId=base64.b64encode(b"x" * 32).decode()), "bundle_mismatch", "logId"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(integratedTime="1"), "bundle_mismatch", "integratedTime"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(logIndex="4"), "bundle_mismatch", "index"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0].update(canonicalizedBody=base64.b64encode(b"{}").decode()), "bundle_mismatch", "canonicalizedBody"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["hashes"].pop(), "bad_proof", "inclusion proof"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["kindVersion"].update(kind="intoto"), "malformed", "kindVersion"),
        (lambda b: b["verificationMaterial"]["tlogEntries"][0]["kindVersion"].update(kind="dvbench-certificate"), "bundle_mismatch", "canonicalizedBody"),
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


def test_every_flipped_byte_is_rejected(bundle: dict[str, Any], sigstore_root: TrustRoot) -> None:
    # Two bits of every byte (the report bundle's test flips all eight; this keeps CI fast):
    # bit 0 turns each digit, letter and base64 character into another, bit 5 flips case.
    # The Sigstore trusted root lists the timestamp authority, so the token is checked too.
    from rfc3161_client import decode_timestamp_response

    text = json.dumps(bundle, sort_keys=True, separators=(",", ":")).encode()
    assert verify_bundle(text, sigstore_root).ok
    stamps = bundle["verificationMaterial"]["timestampVerificationData"]["rfc3161Timestamps"]
    token = stamps[0]["signedTimestamp"].encode()
    start = text.index(token)
    original = decode_timestamp_response(base64.b64decode(token)).tst_info
    accepted = []
    for position in range(len(text)):
        for bit in (0, 5):
            flipped = bytearray(text)
            flipped[position] ^= 1 << bit
            if not verify_bundle(bytes(flipped), sigstore_root).ok:
                continue
            if start <= position < start + len(token):
                # CMS leaves some fields of a token outside its signature, and
                # rfc3161-client reads a few leniently (the signer id's SEQUENCE tag, the
                # hash named in the signature algorithm, which it takes from the digest
                # algorithm). Such a flip must leave the signed TSTInfo as it was.
                changed = json.loads(bytes(flipped))
                raw = changed["verificationMaterial"]["timestampVerificationData"]
                info = decode_timestamp_response(
                    base64.b64decode(raw["rfc3161Timestamps"][0]["signedTimestamp"])
                ).tst_info
                if (info.gen_time, info.message_imprint.message, info.serial_number) == (
                    original.gen_time,
                    original.message_imprint.message,
                    original.serial_number,
                ):
                    continue
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
    """With the key as SSlibKey.from_crypto derives it: no key id set by hand."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    verifier = SSlibKey.from_crypto(key.public_key)
    envelope = Envelope.from_dict(copy.deepcopy(bundle["dsseEnvelope"]))  # it consumes the dict
    assert key.keyid in envelope.verify([verifier], 1)
    assert bundle["verificationMaterial"]["publicKey"]["hint"] == key.keyid == verifier.keyid
    tampered = copy.deepcopy(bundle["dsseEnvelope"])
    payload = bytearray(base64.b64decode(tampered["payload"]))
    payload[10] ^= 1
    tampered["payload"] = base64.b64encode(bytes(payload)).decode()
    with pytest.raises(VerificationError):
        Envelope.from_dict(tampered).verify([verifier], 1)


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


# --- @sigstore/verify (npm's verifier), default policy ------------------------------------

SIGSTORE_JS = Path(__file__).resolve().parents[3] / "sigstore_js"
_NODE = shutil.which("node")
needs_sigstore_js = pytest.mark.skipif(
    _NODE is None or not (SIGSTORE_JS / "node_modules" / "@sigstore" / "verify").is_dir(),
    reason="Sigstore's JavaScript verifier is not installed: needs node and `npm ci` in "
    "tests/sigstore_js (.ci/run does both)",
)


def sigstore_js(bundle: dict[str, Any], root: dict[str, Any], folder: Path) -> str:
    """``@sigstore/verify`` with its default policy (tests/sigstore_js/verify.js): its verdict."""
    (folder / "bundle.sigstore.json").write_text(json.dumps(bundle))
    (folder / "trusted_root.json").write_text(json.dumps(root))
    assert _NODE is not None
    done = subprocess.run(
        [_NODE, str(SIGSTORE_JS / "verify.js"), "bundle.sigstore.json", "trusted_root.json"],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def trusted_root_json(trust_root: TrustRoot, authority: Authority) -> dict[str, Any]:
    return sigstore_trusted_root(
        trust_root, log_origin=ORIGIN, timestamp_authorities=[authority.descriptor()]
    )


def _edit_statement(bundle: dict[str, Any], edit: Any) -> None:
    envelope = bundle["dsseEnvelope"]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    edit(statement)
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    envelope["payload"] = base64.b64encode(payload).decode()


def _one_payload_character(bundle: dict[str, Any]) -> None:
    envelope = bundle["dsseEnvelope"]
    payload = bytearray(base64.b64decode(envelope["payload"]))
    position = payload.index(b"acme/run-7")
    payload[position] = ord("b")
    envelope["payload"] = base64.b64encode(bytes(payload)).decode()


def _checkpoint_root(bundle: dict[str, Any]) -> None:
    proof = _entry(bundle)["inclusionProof"]
    note = proof["checkpoint"]["envelope"]
    lines = note.split("\n")
    lines[2] = base64.b64encode(b"\1" * 32).decode()
    proof["checkpoint"]["envelope"] = "\n".join(lines)
    proof["rootHash"] = lines[2]


def _log_body(bundle: dict[str, Any]) -> None:
    body = json.loads(base64.b64decode(_entry(bundle)["canonicalizedBody"]))
    body["spec"]["envelopeHash"]["value"] = "00" * 32
    encoded = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    _entry(bundle)["canonicalizedBody"] = base64.b64encode(encoded).decode()


def _inclusion_proof(bundle: dict[str, Any]) -> None:
    hashes = _entry(bundle)["inclusionProof"]["hashes"]
    hashes[0] = base64.b64encode(b"\2" * 32).decode()


def _signature(bundle: dict[str, Any]) -> None:
    signature = bundle["dsseEnvelope"]["signatures"][0]
    raw = bytearray(base64.b64decode(signature["sig"]))
    raw[0] ^= 1
    signature["sig"] = base64.b64encode(bytes(raw)).decode()


@needs_sigstore_js
def test_sigstore_js_verifies_it_with_its_default_policy(
    bundle: dict[str, Any], trusted_root_json: dict[str, Any], tmp_path: Path
) -> None:
    assert sigstore_js(bundle, trusted_root_json, tmp_path) == "verified"


@needs_sigstore_js
@pytest.mark.parametrize(
    ("tamper", "error"),
    [
        (_one_payload_character, "TLOG_BODY_ERROR"),
        # The RFC 3161 token stamps the signature, and timestamps are checked first.
        (_signature, "TIMESTAMP_ERROR"),
        (lambda b: _edit_statement(b, lambda s: s["subject"][0]["digest"].update({"zkdv-transcript": "00" * 32})), "TLOG_BODY_ERROR"),
        (_log_body, "TLOG_INCLUSION_PROMISE_ERROR"),
        (_inclusion_proof, "TLOG_INCLUSION_PROOF_ERROR"),
        (_checkpoint_root, "TLOG_INCLUSION_PROOF_ERROR"),
        (_flip_token, "TIMESTAMP_ERROR"),
    ],
    ids=["payload", "signature", "subject", "log-body", "inclusion-proof", "checkpoint", "timestamp"],
)  # fmt: skip
def test_sigstore_js_rejects_each_tamper(
    bundle: dict[str, Any],
    trusted_root_json: dict[str, Any],
    trust_root: TrustRoot,
    tmp_path: Path,
    tamper: Any,
    error: str,
) -> None:
    tampered = copy.deepcopy(bundle)
    tamper(tampered)
    verdict = sigstore_js(tampered, trusted_root_json, tmp_path)
    assert verdict.startswith(error), verdict
    # ... and so does ours (with either trust root).
    assert not verify_bundle(tampered, trust_root).ok or tamper is _flip_token
    assert not verify_bundle(tampered, TrustRoot.from_json(json.dumps(trusted_root_json))).ok


@needs_sigstore_js
def test_sigstore_js_rejects_a_key_outside_its_validity_period(
    bundle: dict[str, Any], key: SigningKey, authority: Authority, tmp_path: Path
) -> None:
    # The same key, published as valid only from a day after the certificate was signed.
    late = TrustRoot.initial(
        key.public_key, not_before=ISSUED + timedelta(days=1), log_origin=ORIGIN
    )
    document = sigstore_trusted_root(
        late, log_origin=ORIGIN, timestamp_authorities=[authority.descriptor()]
    )
    verdict = sigstore_js(bundle, document, tmp_path)
    assert verdict.startswith("PUBLIC_KEY_ERROR: Public key is not valid for timestamp"), verdict
    assert verify_bundle(bundle, late).reason == "key_not_valid"


@needs_sigstore_js
def test_sigstore_js_accepts_no_other_key(
    bundle: dict[str, Any], authority: Authority, tmp_path: Path
) -> None:
    other = TrustRoot.initial(SigningKey.generate().public_key, not_before=START, log_origin=ORIGIN)
    document = sigstore_trusted_root(
        other, log_origin=ORIGIN, timestamp_authorities=[authority.descriptor()]
    )
    verdict = sigstore_js(bundle, document, tmp_path)
    assert verdict.startswith("PUBLIC_KEY_ERROR: key not found"), verdict
