"""Log entries in Rekor's ``dsse`` kind, and the log's signed inclusion promise.

Every certificate issued since log entries took a standard kind is written into the
transparency log as the canonicalized body of a Rekor v1 ``dsse`` entry, version 0.0.1
(``pkg/types/dsse/v0.0.1`` in sigstore/rekor, the JSON schema
``dsse_v0_0_1_schema.json``)::

    {"apiVersion": "0.0.1", "kind": "dsse",
     "spec": {"envelopeHash": {"algorithm": "sha256", "value": "<hex>"},
              "payloadHash": {"algorithm": "sha256", "value": "<hex>"},
              "signatures": [{"signature": "<base64 signature, as in the envelope>",
                              "verifier": "<base64 of the signing key's PEM>"}]}}

* ``envelopeHash`` is the SHA-256 of the envelope's canonical JSON (UTF-8, keys sorted,
  no whitespace: the bytes the DVBench log leaf used to be), so the entry binds every
  byte of the envelope, key ids included;
* ``payloadHash`` is the SHA-256 of the decoded payload (what Sigstore verifiers
  compare with the bundle's envelope);
* ``signatures`` holds the envelope's one signature and the public key that verifies
  it, as PEM SubjectPublicKeyInfo, base64-encoded (Rekor's ``strfmt.Base64``).

The body is canonical JSON as Rekor writes it (RFC 8785 for these all-string fields),
and :func:`dsse_entry_body` recomputes it byte for byte from the envelope and the key,
so a verifier never has to trust the body: a changed payload, signature or key id makes
another body, hence another leaf hash, and the inclusion proof fails.

Entries written before this kind existed keep theirs (:data:`LEGACY_KIND`: the leaf is
the envelope's canonical JSON itself); the log is append-only, and verifiers accept both.

The **signed entry timestamp** (Rekor's inclusion promise, SET) is the log key's
Ed25519 signature over the canonical JSON of
``{"body": "<base64 body>", "integratedTime": <seconds>, "logID": "<hex log id>",
"logIndex": <index>}`` (:func:`inclusion_promise_payload`), exactly what Sigstore's
verifiers check: it makes ``integratedTime`` a signed time.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dvbench.attest._dsse import Envelope, decode_envelope
from dvbench.attest._encoding import canonical_json
from dvbench.attest._errors import MalformedInputError

__all__ = [
    "DSSE_KIND",
    "LEGACY_KIND",
    "dsse_entry_body",
    "entry_body",
    "entry_kind",
    "inclusion_promise_payload",
]

#: Rekor v1's DSSE kind: what every new log entry is.
DSSE_KIND: Final = {"kind": "dsse", "version": "0.0.1"}
#: The kind of entries written before :data:`DSSE_KIND`: the envelope's canonical JSON.
LEGACY_KIND: Final = {"kind": "dvbench-certificate", "version": "0.0.1"}


def _pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def dsse_entry_body(envelope: Mapping[str, Any] | Envelope, public_key: Ed25519PublicKey) -> bytes:
    """The canonicalized body of the Rekor ``dsse`` 0.0.1 entry for a signed envelope.

    Args:
        envelope: the envelope, with exactly one signature (Rekor's DSSE verifiers
            compare the body's one signature with the envelope's).
        public_key: the key that made that signature.

    Returns:
        The body's canonical JSON bytes: the log leaf.

    Raises:
        MalformedInputError: the envelope does not decode or has several signatures.
    """
    _, payload, signatures = decode_envelope(envelope)
    if len(signatures) != 1:
        raise MalformedInputError(
            f"a dsse log entry records one signature; the envelope has {len(signatures)}"
        )
    body = {
        "apiVersion": DSSE_KIND["version"],
        "kind": DSSE_KIND["kind"],
        "spec": {
            "envelopeHash": {
                "algorithm": "sha256",
                "value": hashlib.sha256(canonical_json(envelope)).hexdigest(),
            },
            "payloadHash": {"algorithm": "sha256", "value": hashlib.sha256(payload).hexdigest()},
            "signatures": [
                {
                    "signature": base64.b64encode(signatures[0][1]).decode("ascii"),
                    "verifier": base64.b64encode(_pem(public_key)).decode("ascii"),
                }
            ],
        },
    }
    return canonical_json(body)


def entry_body(
    kind: Mapping[str, str],
    envelope: Mapping[str, Any] | Envelope,
    public_key: Ed25519PublicKey,
) -> bytes:
    """The log leaf of an envelope in entry kind ``kind`` (:data:`DSSE_KIND` or legacy).

    Raises:
        MalformedInputError: the kind is neither, or the envelope does not fit it.
    """
    if dict(kind) == DSSE_KIND:
        return dsse_entry_body(envelope, public_key)
    if dict(kind) == LEGACY_KIND:
        return canonical_json(envelope)
    raise MalformedInputError(
        f"log entry kind {dict(kind)!r:.120} is neither {DSSE_KIND} nor {LEGACY_KIND}"
    )


def entry_kind(body: bytes) -> dict[str, str]:
    """The kind of a stored log leaf: a Rekor body names its kind, an envelope does not."""
    return dict(DSSE_KIND) if body.startswith(b'{"apiVersion":') else dict(LEGACY_KIND)


def inclusion_promise_payload(
    body: bytes, *, integrated_time: int, log_index: int, log_id: bytes
) -> bytes:
    """The bytes a signed entry timestamp signs (Rekor's ``VerifySET`` payload).

    Args:
        body: the entry's canonicalized body.
        integrated_time: the time the log integrated it, Unix seconds.
        log_index: its index in the log.
        log_id: the log's id (its checkpoint key's signed-note key id).
    """
    return canonical_json(
        {
            "body": base64.b64encode(body).decode("ascii"),
            "integratedTime": integrated_time,
            "logID": log_id.hex(),
            "logIndex": log_index,
        }
    )
