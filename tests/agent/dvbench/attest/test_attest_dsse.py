"""DSSE v1: PAE against the specification's test vector, and interoperability with
securesystemslib's independent implementation in both directions."""

from __future__ import annotations

import base64
import copy
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.exceptions import VerificationError

# securesystemslib documents these names but its __init__ does not re-export them for mypy.
from securesystemslib.signer import CryptoSigner, SSlibKey  # type: ignore[attr-defined]

from dvbench.attest import (
    PAYLOAD_TYPE_INTOTO,
    InvalidSignatureError,
    KeyNotValidError,
    MalformedInputError,
    SigningKey,
    TrustRoot,
    UnknownKeyError,
    pae,
    sign_envelope,
    verify_envelope,
)

# The test vector of the DSSE specification, protocol.md "Test Vectors"
# (github.com/secure-systems-lab/dsse, version 1.0.2).
SPEC_PAYLOAD_TYPE = "http://example.com/HelloWorld"
SPEC_PAYLOAD = b"hello world"
SPEC_PAE = b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
SPEC_X = 46950820868899156662930047687818585632848591499744589407958293238635476079160
SPEC_Y = 5640078356564379163099075877009565129882514886557779369047442380624545832820
SPEC_D = 97358161215184420915383655311931858321456579547487070936769975997791359926199
SPEC_ENVELOPE_PAYLOAD = "aGVsbG8gd29ybGQ="
SPEC_SIG = (
    "A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZA=="
)

AT = datetime(2026, 3, 1, tzinfo=UTC)
START = datetime(2026, 1, 1, tzinfo=UTC)


def test_pae_matches_the_specification_test_vector() -> None:
    assert pae(SPEC_PAYLOAD_TYPE, SPEC_PAYLOAD) == SPEC_PAE


def test_the_specification_signature_verifies_over_our_pae() -> None:
    # The vector's ECDSA P-256 signature is raw r || s; re-encode it as DER for pyca.
    public = ec.EllipticCurvePublicNumbers(SPEC_X, SPEC_Y, ec.SECP256R1()).public_key()
    raw = base64.b64decode(SPEC_SIG)
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    public.verify(der, pae(SPEC_PAYLOAD_TYPE, SPEC_PAYLOAD), ec.ECDSA(hashes.SHA256()))
    assert base64.b64decode(SPEC_ENVELOPE_PAYLOAD) == SPEC_PAYLOAD


def test_the_specification_signature_is_reproduced_deterministically() -> None:
    # RFC 6979 deterministic ECDSA over our PAE gives the vector's exact signature.
    private = ec.derive_private_key(SPEC_D, ec.SECP256R1())
    der = private.sign(
        pae(SPEC_PAYLOAD_TYPE, SPEC_PAYLOAD),
        ec.ECDSA(hashes.SHA256(), deterministic_signing=True),
    )
    r, s = decode_dss_signature(der)
    assert base64.b64encode(r.to_bytes(32, "big") + s.to_bytes(32, "big")).decode() == SPEC_SIG


@pytest.mark.parametrize(
    ("payload_type", "payload", "expected"),
    [
        ("", b"", b"DSSEv1 0  0 "),
        ("t", b"x" * 10, b"DSSEv1 1 t 10 xxxxxxxxxx"),
        # LEN counts UTF-8 bytes, not characters: "é" is two bytes.
        ("\u00e9", b"\x00 \n", b"DSSEv1 2 \xc3\xa9 3 \x00 \n"),
    ],
)
def test_pae_lengths_are_byte_counts_in_decimal(
    payload_type: str, payload: bytes, expected: bytes
) -> None:
    assert pae(payload_type, payload) == expected


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def root(key: SigningKey) -> TrustRoot:
    return TrustRoot.initial(key.public_key, not_before=START)


def _private(key: SigningKey) -> Ed25519PrivateKey:
    # What an operator would do with the PEM file: hand it to another implementation.
    private = serialization.load_pem_private_key(key.private_pem(), password=None)
    assert isinstance(private, Ed25519PrivateKey)
    return private


def _sslib_key(key: SigningKey) -> SSlibKey:
    # securesystemslib's key, under our key id so that its keyid matching pairs them.
    return SSlibKey.from_crypto(key.public_key, keyid=key.keyid)


def test_it_round_trips(key: SigningKey, root: TrustRoot) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b'{"a":1}', key)
    assert set(envelope) == {"payload", "payloadType", "signatures"}
    assert envelope["signatures"][0]["keyid"] == key.keyid
    assert verify_envelope(envelope, root, at=AT) == b'{"a":1}'


def test_securesystemslib_verifies_our_envelopes(key: SigningKey) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"payload bytes \x00\xff", key)
    theirs = SslibEnvelope.from_dict(copy.deepcopy(dict(envelope)))
    accepted = theirs.verify([_sslib_key(key)], 1)
    assert list(accepted) == [key.keyid]
    assert theirs.payload == b"payload bytes \x00\xff"
    assert theirs.pae() == pae(PAYLOAD_TYPE_INTOTO, b"payload bytes \x00\xff")


def test_securesystemslib_rejects_our_envelope_when_altered(key: SigningKey) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"payload", key)
    envelope["payload"] = base64.b64encode(b"pay1oad").decode()
    theirs = SslibEnvelope.from_dict(copy.deepcopy(dict(envelope)))
    with pytest.raises(VerificationError):
        theirs.verify([_sslib_key(key)], 1)


def test_we_verify_securesystemslib_envelopes(key: SigningKey, root: TrustRoot) -> None:
    signer = CryptoSigner(_private(key), _sslib_key(key))
    theirs = SslibEnvelope(payload=b'{"x":[1,2]}', payload_type=PAYLOAD_TYPE_INTOTO, signatures={})
    theirs.sign(signer)
    assert verify_envelope(theirs.to_dict(), root, at=AT) == b'{"x":[1,2]}'


def test_we_reject_a_securesystemslib_envelope_by_another_key(
    key: SigningKey, root: TrustRoot
) -> None:
    other = SigningKey.generate()
    signer = CryptoSigner(_private(other), SSlibKey.from_crypto(other.public_key, keyid=key.keyid))
    theirs = SslibEnvelope(payload=b"{}", payload_type=PAYLOAD_TYPE_INTOTO, signatures={})
    theirs.sign(signer)  # claims our key id, signs with another key
    with pytest.raises(InvalidSignatureError, match="does not verify"):
        verify_envelope(theirs.to_dict(), root, at=AT)


def test_urlsafe_base64_is_accepted_as_the_protocol_requires(
    key: SigningKey, root: TrustRoot
) -> None:
    payload = b"\xfb\xff\xfe" * 5  # encodes with '+' and '/' in the standard alphabet
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, payload, key)
    assert "+" in envelope["payload"] or "/" in envelope["payload"]
    envelope["payload"] = base64.urlsafe_b64encode(payload).decode()
    envelope["signatures"][0]["sig"] = base64.urlsafe_b64encode(
        base64.b64decode(envelope["signatures"][0]["sig"])
    ).decode()
    assert verify_envelope(envelope, root, at=AT) == payload


def test_non_canonical_base64_is_refused(key: SigningKey, root: TrustRoot) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"hello world", key)
    assert envelope["payload"] == "aGVsbG8gd29ybGQ="
    # 'R' differs from 'Q' only in the two padding bits: same bytes, another spelling.
    envelope["payload"] = "aGVsbG8gd29ybGR="
    with pytest.raises(MalformedInputError, match="not canonical base64"):
        verify_envelope(envelope, root, at=AT)


def test_tampering_is_detected(key: SigningKey, root: TrustRoot) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"payload", key)
    other_type = dict(envelope, payloadType="application/vnd.in-toto+jsoN")
    with pytest.raises(InvalidSignatureError):
        verify_envelope(other_type, root, at=AT, payload_type="application/vnd.in-toto+jsoN")
    signature = base64.b64decode(envelope["signatures"][0]["sig"])
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    bad_sig = dict(
        envelope, signatures=[{"keyid": key.keyid, "sig": base64.b64encode(flipped).decode()}]
    )
    with pytest.raises(InvalidSignatureError):
        verify_envelope(bad_sig, root, at=AT)


def test_an_unexpected_payload_type_is_refused_after_verification(
    key: SigningKey, root: TrustRoot
) -> None:
    envelope = sign_envelope("application/json", b"{}", key)
    with pytest.raises(MalformedInputError, match=r"expected 'application/vnd.in-toto\+json'"):
        verify_envelope(envelope, root, at=AT)


def test_unknown_key_is_named(root: TrustRoot) -> None:
    stranger = SigningKey.generate()
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"{}", stranger)
    with pytest.raises(UnknownKeyError, match=stranger.keyid):
        verify_envelope(envelope, root, at=AT)


def test_one_trusted_signature_among_several_suffices(key: SigningKey, root: TrustRoot) -> None:
    stranger = SigningKey.generate()
    mine = sign_envelope(PAYLOAD_TYPE_INTOTO, b"{}", key)
    theirs = sign_envelope(PAYLOAD_TYPE_INTOTO, b"{}", stranger)
    both = dict(mine, signatures=theirs["signatures"] + mine["signatures"])
    assert verify_envelope(both, root, at=AT) == b"{}"


def test_the_key_must_be_valid_at_the_signing_time(key: SigningKey, root: TrustRoot) -> None:
    envelope = sign_envelope(PAYLOAD_TYPE_INTOTO, b"{}", key)
    with pytest.raises(KeyNotValidError, match="outside the key's validity window"):
        verify_envelope(envelope, root, at=datetime(2025, 12, 31, 23, 59, 59, tzinfo=UTC))
    # The time may come from the verified payload itself.
    seen: list[bytes] = []

    def signed_time(payload: bytes) -> datetime:
        seen.append(payload)
        return START

    assert verify_envelope(envelope, root, at=signed_time) == b"{}"
    assert seen == [b"{}"]


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        ({}, "lacks field 'payload'"),
        ({"payload": "", "payloadType": "t", "signatures": []}, "signatures is empty"),
        ({"payload": "", "payloadType": "t", "signatures": [{"sig": ""}]}, "lacks field 'keyid'"),
        ({"payload": "", "payloadType": "t", "signatures": [], "x": 1}, "unknown field 'x'"),
        (
            {"payload": "!", "payloadType": "t", "signatures": []},
            "envelope.payload is not valid base64",
        ),
        ({"payload": 1, "payloadType": "t", "signatures": []}, "must be a base64 string"),
        ([], "envelope must be a JSON object"),
    ],
)
def test_malformed_envelopes_are_named(envelope: object, message: str, root: TrustRoot) -> None:
    with pytest.raises(MalformedInputError, match=message):
        verify_envelope(envelope, root, at=AT)  # type: ignore[arg-type]
