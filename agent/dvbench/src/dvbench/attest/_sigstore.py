"""The certificate as a Sigstore bundle v0.3, for tools that read Sigstore's format.

A Sigstore bundle (https://github.com/sigstore/protobuf-specs, ``sigstore_bundle.proto``,
media type :data:`SIGSTORE_BUNDLE_MEDIA_TYPE`) carries the same DSSE envelope as the
report bundle, and the transparency-log entry where Sigstore keeps it::

    {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
     "verificationMaterial": {
       "publicKey": {"hint": "<key id: securesystemslib's id of the platform key>"},
       "tlogEntries": [{
         "logIndex": "41",
         "logId": {"keyId": "<base64 SHA-256(origin || 0x0A || 0x01 || raw key)>"},
         "kindVersion": {"kind": "dsse", "version": "0.0.1"},
         "integratedTime": "<the checkpoint's signed time, Unix seconds>",
         "inclusionPromise": {"signedEntryTimestamp": "<base64 Ed25519 signature>"},
         "inclusionProof": {"logIndex": "41", "rootHash": "<base64>", "treeSize": "42",
                            "hashes": ["<base64>", ...],
                            "checkpoint": {"envelope": "<the signed checkpoint note>"}},
         "canonicalizedBody": "<base64 of the log leaf: the Rekor dsse entry body>"}],
       "timestampVerificationData": {"rfc3161Timestamps": [
         {"signedTimestamp": "<base64 DER TimeStampResp over the envelope's signature>"}]}},
     "dsseEnvelope": {the DSSE envelope, byte for byte as in the report bundle}}

* The key is a bare Ed25519 key named by a hint (no Fulcio certificate, no identity):
  the auditor's trust root (DVBench's, or the Sigstore ``trusted_root.json`` of
  ``dvbench.attest._trusted_root``) says which keys are the platform's and when each
  was valid.
* The log entry is a Rekor v1 ``dsse`` 0.0.1 entry (``dvbench.attest._rekor``), which a
  verifier recomputes from the envelope and the key; ``SHA-256(0x00 || body)`` is the
  leaf hash the RFC 6962 inclusion proof starts from. Entries logged before carry the
  legacy kind (the envelope's canonical JSON as the body), without an inclusion promise
  or a timestamp, and still verify.
* ``logId.keyId`` is the checkpoint key's signed-note key ID: its first four bytes are the
  key hash on the checkpoint's signature line, which is how a Sigstore client finds the
  signature that verifies the checkpoint.
* Signed time: the inclusion promise (the log key's signed entry timestamp over the
  entry and ``integratedTime``, the signed checkpoint's time) and an RFC 3161 timestamp
  by the platform's timestamp authority over the envelope's signature (``issuedOn``).
* The trust root is not inside: it is the auditor's own copy, as ever.

``verify_bundle`` checks all of it offline (``dvbench verify-report`` does so
whenever it is given a Sigstore bundle); ``@sigstore/verify`` does too, with its
default policy, against the Sigstore trusted root.
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
from dvbench.attest._rekor import (
    DSSE_KIND,
    LEGACY_KIND,
    entry_body,
    inclusion_promise_payload,
)
from dvbench.attest._translog import Checkpoint

__all__ = [
    "SIGSTORE_BUNDLE_MEDIA_TYPE",
    "SIGSTORE_ENTRY_KIND",
    "SigstoreLogEntry",
    "make_sigstore_bundle",
    "read_sigstore_bundle",
]

SIGSTORE_BUNDLE_MEDIA_TYPE: Final = "application/vnd.dev.sigstore.bundle.v0.3+json"
#: ``kindVersion`` of a log entry: Rekor v1's ``dsse`` 0.0.1 (``dvbench.attest._rekor``).
#: Entries logged before it carry :data:`~dvbench.attest._rekor.LEGACY_KIND`.
SIGSTORE_ENTRY_KIND: Final = DSSE_KIND
_KINDS: Final = (DSSE_KIND, LEGACY_KIND)


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
    kind: Mapping[str, str] = DSSE_KIND,
    inclusion_promise: bytes | None = None,
    timestamps: Sequence[bytes] = (),
    hint: str | None = None,
) -> dict[str, Any]:
    """The certificate as a Sigstore bundle v0.3 (see the module docstring).

    Args:
        envelope: the signed certificate.
        log_index: its leaf index.
        inclusion_proof: the audit path from that leaf to the checkpoint's root.
        checkpoint: the signed checkpoint note that the proof leads to.
        public_key: the platform key that signed the certificate and the checkpoint.
        kind: the log entry's kind (``dvbench.attest._rekor``); the legacy kind only
            for entries logged before the ``dsse`` kind.
        inclusion_promise: the log's signed entry timestamp over the entry, if any.
        timestamps: RFC 3161 timestamp tokens (DER) over the envelope's signature.
        hint: the key id to name (default: :func:`key_id` of ``public_key``; an older
            certificate names the id its envelope carries).

    Returns:
        The bundle, ready for ``json.dumps``.
    """
    body, _, _ = checkpoint.partition("\n\n")
    head = Checkpoint.parse_body(body + "\n")
    entry: dict[str, Any] = {
        "logIndex": str(log_index),
        "logId": {"keyId": b64encode(note_key_id(head.origin, public_key))},
        "kindVersion": dict(kind),
        "integratedTime": str(int(head.timestamp.timestamp())),
    }
    if inclusion_promise is not None:
        entry["inclusionPromise"] = {"signedEntryTimestamp": b64encode(inclusion_promise)}
    entry["inclusionProof"] = {
        "logIndex": str(log_index),
        "rootHash": b64encode(head.root_hash),
        "treeSize": str(head.tree_size),
        "hashes": [b64encode(value) for value in inclusion_proof],
        "checkpoint": {"envelope": checkpoint},
    }
    entry["canonicalizedBody"] = b64encode(entry_body(kind, envelope, public_key))
    material: dict[str, Any] = {
        "publicKey": {"hint": hint or key_id(public_key)},
        "tlogEntries": [entry],
    }
    if timestamps:
        material["timestampVerificationData"] = {
            "rfc3161Timestamps": [{"signedTimestamp": b64encode(token)} for token in timestamps]
        }
    return {
        "mediaType": SIGSTORE_BUNDLE_MEDIA_TYPE,
        "verificationMaterial": material,
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
        kind: dict[str, str] | None = None,
        inclusion_promise: bytes | None = None,
        timestamps: tuple[bytes, ...] = (),
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
        self.kind = dict(DSSE_KIND) if kind is None else kind
        self.inclusion_promise = inclusion_promise
        self.timestamps = timestamps

    def promise_payload(self) -> bytes:
        """What :attr:`inclusion_promise` must sign (``dvbench.attest._rekor``)."""
        return inclusion_promise_payload(
            self.body,
            integrated_time=int(self.integrated_time.timestamp()),
            log_index=self.log_index,
            log_id=self.log_id,
        )


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
        optional=("timestampVerificationData",),
    )
    timestamps = _rfc3161_timestamps(material)
    key = obj(material["publicKey"], "bundle.verificationMaterial.publicKey", required=("hint",))
    hint = string(key["hint"], "bundle.verificationMaterial.publicKey.hint")
    return document["dsseEnvelope"], _log_entry(material, hint=hint, timestamps=timestamps)


def _rfc3161_timestamps(material: Mapping[str, Any]) -> tuple[bytes, ...]:
    """The RFC 3161 timestamp tokens (DER) of ``verificationMaterial``, if any."""
    timestamps: list[bytes] = []
    if "timestampVerificationData" in material:
        where = "bundle.verificationMaterial.timestampVerificationData"
        data = obj(material["timestampVerificationData"], where, required=("rfc3161Timestamps",))
        for index, item in enumerate(
            array(data["rfc3161Timestamps"], f"{where}.rfc3161Timestamps")
        ):
            token = obj(item, f"{where}.rfc3161Timestamps[{index}]", required=("signedTimestamp",))
            timestamps.append(
                b64decode(
                    token["signedTimestamp"],
                    f"{where}.rfc3161Timestamps[{index}].signedTimestamp",
                )
            )
    return tuple(timestamps)


def _log_entry(
    material: Mapping[str, Any], *, hint: str, timestamps: tuple[bytes, ...]
) -> SigstoreLogEntry:
    """The one ``tlogEntries`` entry of ``verificationMaterial``, its fields checked."""
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
        optional=("inclusionPromise",),
    )
    kind = _entry_kind(entry, what)
    promise = _inclusion_promise(entry, what)
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
    moment = _integrated_time(entry, what)
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
        kind=kind,
        inclusion_promise=promise,
        timestamps=timestamps,
    )
    if fields.proof_index != fields.log_index:
        raise BundleMismatchError(
            f"{what}: the inclusion proof is for index {fields.proof_index}, the entry is "
            f"{fields.log_index}"
        )
    return fields


def _entry_kind(entry: Mapping[str, Any], what: str) -> dict[str, str]:
    """The entry's ``kindVersion``: the ``dsse`` kind, or the legacy one."""
    kind = obj(entry["kindVersion"], f"{what}.kindVersion", required=("kind", "version"))
    if dict(kind) not in _KINDS:
        raise MalformedInputError(
            f"{what}.kindVersion must be {DSSE_KIND} (or {LEGACY_KIND} for entries logged "
            f"before it), got {dict(kind)!r:.120}"
        )
    return dict(kind)


def _inclusion_promise(entry: Mapping[str, Any], what: str) -> bytes | None:
    """The log's signed entry timestamp over the entry, if it has one."""
    if "inclusionPromise" not in entry:
        return None
    return b64decode(
        obj(
            entry["inclusionPromise"],
            f"{what}.inclusionPromise",
            required=("signedEntryTimestamp",),
        )["signedEntryTimestamp"],
        f"{what}.inclusionPromise.signedEntryTimestamp",
    )


def _integrated_time(entry: Mapping[str, Any], what: str) -> datetime:
    """``integratedTime``: Unix seconds, as a calendar time."""
    seconds = _u64(entry["integratedTime"], f"{what}.integratedTime")
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedInputError(f"{what}.integratedTime is not a calendar time") from None
