"""The certificate as a Sigstore bundle v0.3, for tools that read Sigstore's format.

A Sigstore bundle (https://github.com/sigstore/protobuf-specs, ``sigstore_bundle.proto``,
media type :data:`SIGSTORE_BUNDLE_MEDIA_TYPE`) carries the same DSSE envelope as the
report bundle, and the transparency-log entry where Sigstore keeps it::

    {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
     "verificationMaterial": {
       "publicKey": {"hint": "<key id: hex SHA-256 of the key's SubjectPublicKeyInfo>"},
       "tlogEntries": [{
         "logIndex": "41",
         "logId": {"keyId": "<base64 SHA-256(origin || 0x0A || 0x01 || raw key)>"},
         "kindVersion": {"kind": "dvbench-certificate", "version": "0.0.1"},
         "integratedTime": "<the checkpoint's signed time, Unix seconds>",
         "inclusionProof": {"logIndex": "41", "rootHash": "<base64>", "treeSize": "42",
                            "hashes": ["<base64>", ...],
                            "checkpoint": {"envelope": "<the signed checkpoint note>"}},
         "canonicalizedBody": "<base64 of the log leaf: the envelope's canonical JSON>"}]},
     "dsseEnvelope": {the DSSE envelope, byte for byte as in the report bundle}}

Where the formats differ:

* The key is a bare Ed25519 key named by a hint (no Fulcio certificate, no identity):
  the auditor's trust root says which keys are the platform's and when each was valid.
* The log entry is not a Rekor entry. Its ``canonicalizedBody`` is the DVBench log leaf
  (the envelope's canonical JSON), so ``kindVersion`` names its own kind, and
  ``SHA-256(0x00 || body)`` is the leaf hash the RFC 6962 inclusion proof starts from.
* ``logId.keyId`` is the checkpoint key's signed-note key ID: its first four bytes are the
  key hash on the checkpoint's signature line, which is how a Sigstore client finds the
  signature that verifies the checkpoint.
* There is no inclusion promise (SET): the signed checkpoint's timestamp line is the
  signed time, and ``integratedTime`` repeats it.
* The trust root is not inside: it is the auditor's own copy, as ever.

:func:`verify_sigstore_bundle` checks all of it offline (``dvbench verify-report`` does so
whenever it is given a Sigstore bundle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dvbench.attest._dsse import Envelope
from dvbench.attest._encoding import array, b64decode, b64encode, obj, string
from dvbench.attest._errors import BundleMismatchError, MalformedInputError
from dvbench.attest._keys import key_id
from dvbench.attest._note import note_key_id
from dvbench.attest._translog import Checkpoint

__all__ = [
    "SIGSTORE_BUNDLE_MEDIA_TYPE",
    "SIGSTORE_ENTRY_KIND",
    "SigstoreLogEntry",
    "make_sigstore_bundle",
    "read_sigstore_bundle",
]

SIGSTORE_BUNDLE_MEDIA_TYPE: Final = "application/vnd.dev.sigstore.bundle.v0.3+json"
#: ``kindVersion`` of a DVBench log entry: not a Rekor kind, so no Rekor-specific
#: verifier mistakes the body for one of its own.
SIGSTORE_ENTRY_KIND: Final = {"kind": "dvbench-certificate", "version": "0.0.1"}


def _u64(value: object, what: str) -> int:
    # Protobuf's JSON mapping writes 64-bit integers as decimal strings; one spelling.
    if not isinstance(value, str) or not value.isdigit() or (len(value) > 1 and value[0] == "0"):
        raise MalformedInputError(f"{what} must be a decimal string, got {value!r:.40}")
    number = int(value)
    if number >= 1 << 64:
        raise MalformedInputError(f"{what} exceeds 2**64 - 1")
    return number


def make_sigstore_bundle(
    envelope: Envelope | Mapping[str, Any],
    *,
    log_index: int,
    inclusion_proof: Sequence[bytes],
    checkpoint: str,
    public_key: Ed25519PublicKey,
) -> dict[str, Any]:
    """The certificate as a Sigstore bundle v0.3 (see the module docstring).

    Args:
        envelope: the signed certificate.
        log_index: its leaf index.
        inclusion_proof: the audit path from that leaf to the checkpoint's root.
        checkpoint: the signed checkpoint note that the proof leads to.
        public_key: the platform key that signed the certificate and the checkpoint.

    Returns:
        The bundle, ready for ``json.dumps``.
    """
    from dvbench.attest._bundle import envelope_leaf

    body, _, _ = checkpoint.partition("\n\n")
    head = Checkpoint.parse_body(body + "\n")
    return {
        "mediaType": SIGSTORE_BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {
            "publicKey": {"hint": key_id(public_key)},
            "tlogEntries": [
                {
                    "logIndex": str(log_index),
                    "logId": {"keyId": b64encode(note_key_id(head.origin, public_key))},
                    "kindVersion": dict(SIGSTORE_ENTRY_KIND),
                    "integratedTime": str(int(head.timestamp.timestamp())),
                    "inclusionProof": {
                        "logIndex": str(log_index),
                        "rootHash": b64encode(head.root_hash),
                        "treeSize": str(head.tree_size),
                        "hashes": [b64encode(value) for value in inclusion_proof],
                        "checkpoint": {"envelope": checkpoint},
                    },
                    "canonicalizedBody": b64encode(envelope_leaf(envelope)),
                }
            ],
        },
        "dsseEnvelope": dict(envelope),
    }


class SigstoreLogEntry:
    """The parts of a Sigstore bundle's one log entry that :func:`verify_bundle` checks."""

    def __init__(
        self,
        *,
        hint: str,
        log_index: int,
        log_id: bytes,
        integrated_time: datetime,
        proof_index: int,
        tree_size: int,
        root_hash: bytes,
        hashes: list[bytes],
        checkpoint: str,
        body: bytes,
    ) -> None:
        self.hint = hint
        self.log_index = log_index
        self.log_id = log_id
        self.integrated_time = integrated_time
        self.proof_index = proof_index
        self.tree_size = tree_size
        self.root_hash = root_hash
        self.hashes = hashes
        self.checkpoint = checkpoint
        self.body = body


def read_sigstore_bundle(data: object) -> tuple[object, SigstoreLogEntry]:
    """Strictly read a Sigstore bundle written by :func:`make_sigstore_bundle`.

    Returns:
        The DSSE envelope (unverified) and the log entry's fields.

    Raises:
        MalformedInputError: a field is missing, unknown or badly encoded.
        BundleMismatchError: the bundle's parts contradict each other.
    """
    document = obj(data, "bundle", required=("mediaType", "verificationMaterial", "dsseEnvelope"))
    if document["mediaType"] != SIGSTORE_BUNDLE_MEDIA_TYPE:
        raise MalformedInputError(
            f"bundle.mediaType must be {SIGSTORE_BUNDLE_MEDIA_TYPE!r}, "
            f"got {document['mediaType']!r:.80}"
        )
    material = obj(
        document["verificationMaterial"],
        "bundle.verificationMaterial",
        required=("publicKey", "tlogEntries"),
    )
    key = obj(material["publicKey"], "bundle.verificationMaterial.publicKey", required=("hint",))
    hint = string(key["hint"], "bundle.verificationMaterial.publicKey.hint")
    entries = array(material["tlogEntries"], "bundle.verificationMaterial.tlogEntries")
    if len(entries) != 1:
        raise MalformedInputError(
            f"bundle.verificationMaterial.tlogEntries must hold one entry, got {len(entries)}"
        )
    what = "bundle.verificationMaterial.tlogEntries[0]"
    entry = obj(
        entries[0],
        what,
        required=(
            "logIndex",
            "logId",
            "kindVersion",
            "integratedTime",
            "inclusionProof",
            "canonicalizedBody",
        ),
    )
    kind = obj(entry["kindVersion"], f"{what}.kindVersion", required=("kind", "version"))
    if dict(kind) != SIGSTORE_ENTRY_KIND:
        raise MalformedInputError(
            f"{what}.kindVersion must be {SIGSTORE_ENTRY_KIND}, got {dict(kind)!r:.120}"
        )
    log_id = b64decode(
        obj(entry["logId"], f"{what}.logId", required=("keyId",))["keyId"], f"{what}.logId.keyId"
    )
    proof = obj(
        entry["inclusionProof"],
        f"{what}.inclusionProof",
        required=("logIndex", "rootHash", "treeSize", "hashes", "checkpoint"),
    )
    note = obj(proof["checkpoint"], f"{what}.inclusionProof.checkpoint", required=("envelope",))[
        "envelope"
    ]
    if not isinstance(note, str):
        raise MalformedInputError(f"{what}.inclusionProof.checkpoint.envelope must be a string")
    seconds = _u64(entry["integratedTime"], f"{what}.integratedTime")
    try:
        moment = datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedInputError(f"{what}.integratedTime is not a calendar time") from None
    fields = SigstoreLogEntry(
        hint=hint,
        log_index=_u64(entry["logIndex"], f"{what}.logIndex"),
        log_id=log_id,
        integrated_time=moment,
        proof_index=_u64(proof["logIndex"], f"{what}.inclusionProof.logIndex"),
        tree_size=_u64(proof["treeSize"], f"{what}.inclusionProof.treeSize"),
        root_hash=b64decode(proof["rootHash"], f"{what}.inclusionProof.rootHash"),
        hashes=[
            b64decode(value, f"{what}.inclusionProof.hashes[{index}]")
            for index, value in enumerate(array(proof["hashes"], f"{what}.inclusionProof.hashes"))
        ],
        checkpoint=note,
        body=b64decode(entry["canonicalizedBody"], f"{what}.canonicalizedBody"),
    )
    if fields.proof_index != fields.log_index:
        raise BundleMismatchError(
            f"{what}: the inclusion proof is for index {fields.proof_index}, the entry is "
            f"{fields.log_index}"
        )
    return document["dsseEnvelope"], fields
