"""DSSE v1 envelopes (https://github.com/secure-systems-lab/dsse, protocol.md, envelope.md).

A signature covers ``PAE(payloadType, payload)``, never the JSON around it, so the
envelope may be re-serialised freely while the signed bytes stay exact. The envelope::

    {"payload": "<base64 of the serialized body>",
     "payloadType": "application/vnd.in-toto+json",
     "signatures": [{"keyid": "<hex SHA-256 of the SPKI DER>", "sig": "<base64 Ed25519>"}]}

Verification follows the protocol's "To verify" steps: decode, narrow the candidate keys
by key id (a hint only: the key must then verify the signature), verify over PAE, reject
an unexpected payload type, and hand back exactly the bytes that were verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Final, TypedDict

from dvbench.attest._encoding import array, b64decode, b64encode, obj, string, to_seconds
from dvbench.attest._errors import (
    AttestationError,
    InvalidSignatureError,
    KeyNotValidError,
    MalformedInputError,
    UnknownKeyError,
)
from dvbench.attest._keys import Signer, TrustedKey, TrustRoot

__all__ = [
    "PAYLOAD_TYPE_INTOTO",
    "Envelope",
    "EnvelopeSignature",
    "pae",
    "sign_envelope",
    "verify_envelope",
]

PAYLOAD_TYPE_INTOTO: Final = "application/vnd.in-toto+json"


class EnvelopeSignature(TypedDict):
    """One entry of an envelope's ``signatures`` list."""

    keyid: str
    sig: str


class Envelope(TypedDict):
    """The DSSE JSON envelope (envelope.md), as a dict ready for ``json.dumps``."""

    payload: str
    payloadType: str  # the wire name, camelCase as envelope.md spells it
    signatures: list[EnvelopeSignature]


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE Pre-Authentication Encoding (protocol.md, "Signature Definition").

    ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``, where ``LEN`` is the byte
    length in ASCII decimal with no leading zeros and ``type`` is UTF-8.

    Args:
        payload_type: the payload type; encoded as UTF-8.
        payload: the serialized body.

    Returns:
        The bytes that are signed.
    """
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(payload), payload)


def sign_envelope(payload_type: str, payload: bytes, signer: Signer) -> Envelope:
    """Sign ``payload`` into a one-signature envelope.

    Args:
        payload_type: e.g. :data:`PAYLOAD_TYPE_INTOTO`.
        payload: the serialized body, signed exactly as given.
        signer: the signing key; its key id goes into the envelope as the hint.

    Returns:
        The envelope.
    """
    if not payload_type:
        raise ValueError("payload type must not be empty")
    signature = signer.sign(pae(payload_type, payload))
    return {
        "payload": b64encode(payload),
        "payloadType": payload_type,
        "signatures": [{"keyid": signer.keyid, "sig": b64encode(signature)}],
    }


def decode_envelope(envelope: object) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    """Strictly decode an envelope into ``(payload_type, payload, [(keyid, sig)])``.

    Raises:
        MalformedInputError: a field is missing, unknown or badly encoded.
    """
    data = obj(envelope, "envelope", required=("payload", "payloadType", "signatures"))
    payload = b64decode(data["payload"], "envelope.payload")
    payload_type = string(data["payloadType"], "envelope.payloadType")
    entries = array(data["signatures"], "envelope.signatures")
    if not entries:
        raise MalformedInputError("envelope.signatures is empty")
    signatures: list[tuple[str, bytes]] = []
    for index, entry in enumerate(entries):
        what = f"envelope.signatures[{index}]"
        # keyid is optional in DSSE; we sign with it and need it to choose a key.
        item = obj(entry, what, required=("keyid", "sig"))
        keyid = string(item["keyid"], f"{what}.keyid")
        signatures.append((keyid, b64decode(item["sig"], f"{what}.sig")))
    return payload_type, payload, signatures


def verify_envelope(
    envelope: Mapping[str, object] | Envelope,
    trust_root: TrustRoot,
    *,
    at: datetime | Callable[[bytes], datetime],
    payload_type: str = PAYLOAD_TYPE_INTOTO,
) -> bytes:
    """Verify an envelope against the trust root; return the verified payload.

    One signature by a trusted key, valid at the signing time, suffices (a
    ``(1, n)``-envelope in protocol.md's terms). Signatures by keys the trust root does
    not list are skipped, as the protocol allows; at least one must be by a listed key.

    Args:
        envelope: the JSON envelope.
        trust_root: the keys to trust and their validity windows.
        at: the signing time at which each key's validity is judged, or a function that
            reads it from the payload. The function only ever sees bytes whose signature
            has verified, and is what certificates use: their signing time is signed.
        payload_type: the only payload type accepted.

    Returns:
        The payload bytes exactly as verified (callers must not re-read the envelope).

    Raises:
        MalformedInputError: the envelope does not decode.
        UnknownKeyError: no signature names a key the trust root lists.
        InvalidSignatureError: no listed key's signature verifies over PAE.
        KeyNotValidError: the verifying key was outside its window at the signing time.
    """
    return _verify_envelope(envelope, trust_root, at=at, payload_type=payload_type)[0]


def _verify_envelope(
    envelope: object,
    trust_root: TrustRoot,
    *,
    at: datetime | Callable[[bytes], datetime],
    payload_type: str,
    what: str = "envelope signature",
) -> tuple[bytes, TrustedKey]:
    """:func:`verify_envelope`, also returning the key that verified."""
    kind, payload, signatures = decode_envelope(envelope)
    signed = pae(kind, payload)
    failure: AttestationError | None = None
    for keyid, signature in signatures:
        try:
            key = trust_root.key(keyid)
            key.verify(signature, signed, what)
        except (UnknownKeyError, InvalidSignatureError) as error:
            # Prefer the more telling error: a listed key that failed beats an unknown one.
            if failure is None or isinstance(error, InvalidSignatureError):
                failure = error
            continue
        # protocol.md: reject an unsupported type only after the signature verified,
        # and parse (here: read the signing time) only the verified bytes.
        if kind != payload_type:
            raise MalformedInputError(
                f"envelope.payloadType is {kind!r}, expected {payload_type!r}"
            )
        moment = at(payload) if callable(at) else at
        try:
            key.check_valid_at(to_seconds(moment), what)
        except KeyNotValidError as error:
            failure = error
            continue
        return payload, key
    assert failure is not None  # decode_envelope refuses an empty signature list
    raise failure
