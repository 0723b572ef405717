"""Certificates, their log entries, and the offline report bundle.

Issuing (the platform, in this order): reserve the next log index; build a
:class:`~dvbench.attest.TrainingCertificate` naming it; :func:`sign_certificate`;
append the leaf hash of the envelope's Rekor ``dsse`` entry
(``dvbench.attest._rekor.dsse_entry_body``) to the log; sign a checkpoint and the
entry's signed entry timestamp; hand out :func:`make_bundle`.

The log leaf of a certificate is that ``dsse`` entry body: canonical JSON naming the
SHA-256 of the envelope's canonical JSON (:func:`envelope_leaf`), of its payload, its
signature and the key, and the leaf hash is ``SHA-256(0x00 || leaf)`` (RFC 9162 section
2.1.1). Any change to any byte of the envelope, signature included, is a change of
leaf. Entries logged before that kind have the envelope's canonical JSON itself as their
leaf; the bundle's ``inclusion_proof.kind`` says which (absent: the older kind).

The bundle (``format`` :data:`BUNDLE_FORMAT`)::

    {"format": "https://dvbench.dev/report-bundle/v1",
     "envelope": {DSSE envelope over the in-toto statement},
     "inclusion_proof": {"log_index": 41, "tree_size": 42, "hashes": ["<hex>", ...],
                         "kind": {"kind": "dsse", "version": "0.0.1"}},
     "checkpoint": "<signed checkpoint note>",
     "trust_root": {the trust root in force at signing}}

:func:`verify_bundle` needs nothing but the bundle, the auditor's own copy of the trust
root and optionally the transcript file; it never touches the network.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from dvbench.attest._certificate import (
    SUBJECT_MODEL_SIGNING_PREFIX,
    SUBJECT_PARAMETERS,
    SUBJECT_TRANSCRIPT,
    SUBJECT_TRANSCRIPT_FILE,
    TrainingCertificate,
    certificate_time,
)
from dvbench.attest._dsse import PAYLOAD_TYPE_INTOTO, Envelope, _verify_envelope, sign_envelope
from dvbench.attest._encoding import (
    array,
    canonical_json,
    format_time,
    hex_decode,
    integer,
    obj,
    parse_json,
    to_seconds,
)
from dvbench.attest._errors import (
    AttestationError,
    BundleMismatchError,
    MalformedInputError,
    SubjectMismatchError,
    UnknownKeyError,
)
from dvbench.attest._intoto import Statement
from dvbench.attest._keys import Signer, TrustedKey, TrustRoot
from dvbench.attest._model_signing import MODEL_SIGNATURE_FILE, model_signature_subject
from dvbench.attest._note import note_key_id
from dvbench.attest._rekor import DSSE_KIND, LEGACY_KIND, entry_body
from dvbench.attest._sigstore import read_sigstore_bundle
from dvbench.attest._translog import Checkpoint, leaf_hash, verify_checkpoint, verify_inclusion

__all__ = [
    "BUNDLE_FORMAT",
    "MAX_CLOCK_SKEW",
    "BundleVerification",
    "envelope_leaf",
    "envelope_leaf_hash",
    "make_bundle",
    "sign_certificate",
    "verify_bundle",
    "verify_certificate",
]

BUNDLE_FORMAT: Final = "https://dvbench.dev/report-bundle/v1"
# Signed times may run this far ahead of the verifier's clock before they are refused.
MAX_CLOCK_SKEW: Final = timedelta(minutes=5)


def sign_certificate(certificate: TrainingCertificate, signer: Signer) -> Envelope:
    """Sign a certificate's statement into a DSSE envelope (in-toto payload type).

    The signer does not know the trust root: a key used outside its validity window
    signs happily here, and every verifier then refuses the certificate.

    Args:
        certificate: what to sign; its ``issued_at`` is the signing time verifiers use.
        signer: the platform's current key.

    Returns:
        The envelope; append :func:`envelope_leaf_hash` of it to the log.
    """
    return sign_envelope(PAYLOAD_TYPE_INTOTO, certificate.to_statement().to_json(), signer)


def envelope_leaf(envelope: Mapping[str, Any] | Envelope) -> bytes:
    """The envelope's canonical JSON bytes: the log leaf of the legacy entry kind.

    New entries are Rekor ``dsse`` bodies (:func:`dvbench.attest.dsse_entry_body`),
    whose ``envelopeHash`` is the SHA-256 of these bytes.
    """
    return canonical_json(envelope)


def envelope_leaf_hash(envelope: Mapping[str, Any] | Envelope) -> bytes:
    """``SHA-256(0x00 || canonical envelope JSON)``, what the log stores (RFC 9162 2.1.1)."""
    return leaf_hash(envelope_leaf(envelope))


def _verify_certificate(
    envelope: object, trust_root: TrustRoot
) -> tuple[TrainingCertificate, TrustedKey]:
    # The key's validity is judged at the certificate's own signed issuedOn time, read
    # from the payload only after its signature has verified.
    payload, key = _verify_envelope(
        envelope,
        trust_root,
        at=certificate_time,
        payload_type=PAYLOAD_TYPE_INTOTO,
        what="certificate signature",
    )
    return TrainingCertificate.from_statement(Statement.from_json(payload)), key


def verify_certificate(
    envelope: Mapping[str, Any] | Envelope, trust_root: TrustRoot
) -> TrainingCertificate:
    """Verify a certificate envelope: signature, payload type, schema, key validity.

    The key must be valid at the certificate's own signed ``issuedOn`` time.

    Returns:
        The certificate.

    Raises:
        MalformedInputError: the envelope or its statement is malformed.
        UnknownKeyError: no signature is by a key of the trust root.
        InvalidSignatureError: no trusted signature verifies.
        KeyNotValidError: the key was outside its validity window at ``issuedOn``.
    """
    return _verify_certificate(envelope, trust_root)[0]


def make_bundle(
    envelope: Envelope | Mapping[str, Any],
    *,
    log_index: int,
    inclusion_proof: Sequence[bytes],
    checkpoint: str,
    tree_size: int,
    trust_root: TrustRoot,
    kind: Mapping[str, str] = LEGACY_KIND,
) -> dict[str, Any]:
    """Assemble the offline report bundle.

    Args:
        envelope: the signed certificate.
        log_index: its leaf index.
        inclusion_proof: the audit path from that leaf to the checkpoint's root.
        checkpoint: the signed checkpoint note.
        tree_size: the checkpoint's tree size.
        trust_root: the trust root named in the certificate.
        kind: the log entry's kind; ``inclusion_proof.kind`` names it unless it is the
            legacy kind (bundles of entries logged before the ``dsse`` kind are unchanged).

    Returns:
        The bundle, ready for ``json.dumps``.
    """
    proof: dict[str, Any] = {
        "log_index": log_index,
        "tree_size": tree_size,
        "hashes": [value.hex() for value in inclusion_proof],
    }
    if dict(kind) != LEGACY_KIND:
        proof["kind"] = dict(kind)
    return {
        "format": BUNDLE_FORMAT,
        "envelope": dict(envelope),
        "inclusion_proof": proof,
        "checkpoint": checkpoint,
        "trust_root": trust_root.to_dict(),
    }


@dataclass(frozen=True)
class BundleVerification:
    """The outcome of :func:`verify_bundle`; ``ok`` is False exactly when ``reason`` is set.

    Attributes:
        ok: every check passed.
        reason: the failing check's code (an :class:`AttestationError` ``reason``).
        message: what failed, precisely.
        certificate: the verified certificate, when the signature checks got that far.
        checkpoint: the verified checkpoint, likewise.
        keyid: the key that signed the certificate.
        transcript_checked: a local transcript was verified against the subject.
    """

    ok: bool
    reason: str | None = None
    message: str | None = None
    certificate: TrainingCertificate | None = None
    checkpoint: Checkpoint | None = None
    keyid: str | None = None
    transcript_checked: bool = False
    model_checked: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for people."""
        if not self.ok:
            return f"rejected ({self.reason}): {self.message}"
        assert self.certificate is not None and self.checkpoint is not None
        certificate = self.certificate
        text = (
            f"verified: certificate {certificate.result.value} issued {format_time(certificate.issued_at)} "
            f"by key {self.keyid}, log entry {certificate.log.index} of {certificate.log.origin} "
            f"(tree size {self.checkpoint.tree_size}), transcript {certificate.transcript_digest}"
        )
        if self.transcript_checked:
            text += " (matches the local transcript)"
        if self.model_checked:
            text += "; model: " + ", ".join(self.model_checked)
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        certificate = self.certificate
        return {
            "ok": self.ok,
            "reason": self.reason,
            "message": self.message,
            "keyid": self.keyid,
            "transcript_checked": self.transcript_checked,
            "model_checked": list(self.model_checked),
            "statement": None if certificate is None else certificate.to_statement().to_dict(),
            "checkpoint": None
            if self.checkpoint is None
            else {
                "origin": self.checkpoint.origin,
                "tree_size": self.checkpoint.tree_size,
                "root_hash": self.checkpoint.root_hash.hex(),
                "timestamp": format_time(self.checkpoint.timestamp),
            },
        }


def _check_trust_root_copy(
    embedded: object, certificate: TrainingCertificate, trust_root: TrustRoot
) -> None:
    # The bundle's copy must be the trust root the certificate names (its digest is
    # signed), and it may not contradict the auditor's own copy on any key.
    copy = TrustRoot.from_dict(embedded, "bundle.trust_root")
    if (
        copy.version != certificate.trust_root_version
        or copy.digest() != certificate.trust_root_digest
    ):
        raise BundleMismatchError(
            f"bundle.trust_root (version {copy.version}, sha256 {copy.digest()}) is not the trust root "
            f"the certificate was issued under (version {certificate.trust_root_version}, "
            f"sha256 {certificate.trust_root_digest})"
        )
    for key in copy.keys:
        try:
            mine = trust_root.key(key.keyid)
        except UnknownKeyError:
            continue
        if mine.not_before != key.not_before:
            raise BundleMismatchError(
                f"bundle.trust_root gives key {key.keyid} a start of {format_time(key.not_before)}, "
                f"the given trust root {format_time(mine.not_before)}"
            )


def _transcript_digest(path: str | os.PathLike[str]) -> str:
    # Imported here: zkdv pulls in numpy, which bundle-only verification does not need.
    from zkdv.records import RECORDS_FILE
    from zkdv.verify import verify_transcript

    location = Path(path)
    if not location.exists():
        # A path that names nothing is a mistake in the command, not a file that differs
        # from the certificate's: malformed, as for a bundle that cannot be read.
        raise MalformedInputError(
            f"cannot read transcript {location}: no such file or directory (give the "
            "proof directory or its records.cborl)"
        )
    folder = location if location.is_dir() else location.parent
    records = location / RECORDS_FILE if location.is_dir() else location
    # Probe continuity needs probes.bin; an auditor may hold only the records.
    report = verify_transcript(records, probes=(folder / "probes.bin").exists())
    if not report.ok or report.digest is None:
        raise SubjectMismatchError(f"transcript {location} does not verify: {report.summary()}")
    return report.digest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_transcript(certificate: TrainingCertificate, path: str | os.PathLike[str]) -> None:
    digest = _transcript_digest(path)
    if digest != certificate.transcript_digest:
        raise SubjectMismatchError(
            f"transcript {path} has digest {digest}, the certificate's subject is "
            f"{certificate.transcript_digest}"
        )
    location = Path(path)
    records = location / SUBJECT_TRANSCRIPT_FILE if location.is_dir() else location
    actual: str | None = None
    for name, signed in (
        (SUBJECT_TRANSCRIPT_FILE, certificate.sha256_subject(SUBJECT_TRANSCRIPT_FILE)),
        (SUBJECT_TRANSCRIPT, certificate.transcript_sha256),
    ):
        if signed is None:
            continue  # certificates issued before the sha256 digests existed
        actual = actual or _sha256_file(records)
        if actual != signed:
            raise SubjectMismatchError(
                f"{records} has sha256 {actual}, the certificate's {name} subject is {signed}"
            )


def _check_model(certificate: TrainingCertificate, path: str | os.PathLike[str]) -> list[str]:
    """Check a model file (or a folder of them, with ``model.sig``) against the subjects.

    Returns:
        What was checked, one line each.
    """
    location = Path(path)
    if not location.exists():
        raise MalformedInputError(
            f"cannot read model {location}: no such file or directory (give the model "
            "folder or its .safetensors file)"
        )
    folder = location if location.is_dir() else location.parent
    files = (
        sorted(p for p in location.iterdir() if p.suffix == ".safetensors")
        if location.is_dir()
        else [location]
    )
    if not files:
        raise SubjectMismatchError(f"{location} holds no .safetensors file")
    checked: list[str] = []
    for file in files:
        signed = certificate.sha256_subject(file.name)
        if signed is None:
            raise SubjectMismatchError(
                f"the certificate binds no model file named {file.name!r} (its subjects: "
                f"{', '.join(s.name for s in certificate.extra_subjects) or 'none'})"
            )
        actual = _sha256_file(file)
        if actual != signed:
            raise SubjectMismatchError(
                f"{file} has sha256 {actual}, the certificate's subject {file.name!r} is {signed}"
            )
        checked.append(f"{file.name} sha256 {actual}")
    signed_weights = certificate.parameters_sha256
    if signed_weights is not None and len(files) == 1:
        actual = _sha256_file(files[0])
        if actual != signed_weights:
            raise SubjectMismatchError(
                f"{files[0]} has sha256 {actual}, the certificate's {SUBJECT_PARAMETERS} "
                f"subject is {signed_weights}"
            )
    signature = folder / MODEL_SIGNATURE_FILE
    if signature.is_file():
        name, manifest = model_signature_subject(signature.read_bytes())
        signed = certificate.sha256_subject(f"{SUBJECT_MODEL_SIGNING_PREFIX}{name}")
        if signed is None or signed != manifest:
            raise SubjectMismatchError(
                f"{signature} signs the model_signing manifest sha256 {manifest} of {name!r}; "
                f"the certificate binds {signed or 'no model_signing manifest of that name'}"
            )
        checked.append(f"{signature.name} manifest sha256 {manifest}")
    return checked


def _check_log(
    certificate: TrainingCertificate,
    leaf: bytes,
    *,
    log_index: int,
    tree_size: int,
    hashes: Sequence[bytes],
    checkpoint: Checkpoint,
    moment: datetime,
) -> None:
    """Checks 8-10 of the module docstring: the log entry proves this certificate."""
    if checkpoint.origin != certificate.log.origin:
        raise BundleMismatchError(
            f"checkpoint is from log {checkpoint.origin!r}, the certificate from {certificate.log.origin!r}"
        )
    if log_index != certificate.log.index:
        raise BundleMismatchError(
            f"inclusion proof is for log index {log_index}, the certificate is entry {certificate.log.index}"
        )
    if tree_size != checkpoint.tree_size:
        raise BundleMismatchError(
            f"inclusion proof is for tree size {tree_size}, the checkpoint for {checkpoint.tree_size}"
        )
    for position, value in enumerate(hashes):
        if len(value) != 32:
            raise MalformedInputError(f"inclusion proof hash {position} is not 32 bytes")
    verify_inclusion(
        leaf_hash(leaf),
        log_index,
        tree_size,
        hashes,
        checkpoint.root_hash,
    )
    if certificate.issued_at > checkpoint.timestamp:
        raise BundleMismatchError(
            f"certificate issued {format_time(certificate.issued_at)} after the checkpoint that "
            f"includes it ({format_time(checkpoint.timestamp)})"
        )
    if checkpoint.timestamp > moment + MAX_CLOCK_SKEW:
        raise BundleMismatchError(
            f"checkpoint time {format_time(checkpoint.timestamp)} is in the future "
            f"(now {format_time(moment)})"
        )


def _report_bundle(
    document: Mapping[str, Any], trust_root: TrustRoot, moment: datetime, state: dict[str, Any]
) -> TrainingCertificate:
    document = obj(
        document,
        "bundle",
        required=("format", "envelope", "inclusion_proof", "checkpoint", "trust_root"),
    )
    if document["format"] != BUNDLE_FORMAT:
        raise MalformedInputError(
            f"bundle.format must be {BUNDLE_FORMAT!r}, got {document['format']!r:.80}"
        )
    proof = obj(
        document["inclusion_proof"],
        "bundle.inclusion_proof",
        required=("log_index", "tree_size", "hashes"),
        optional=("kind",),
    )
    kind = (
        dict(obj(proof["kind"], "bundle.inclusion_proof.kind", required=("kind", "version")))
        if "kind" in proof
        else dict(LEGACY_KIND)
    )
    if kind not in (DSSE_KIND, LEGACY_KIND):
        raise MalformedInputError(
            f"bundle.inclusion_proof.kind must be {DSSE_KIND}, got {kind!r:.120}"
        )
    log_index = integer(proof["log_index"], "bundle.inclusion_proof.log_index")
    tree_size = integer(proof["tree_size"], "bundle.inclusion_proof.tree_size")
    hashes = [
        hex_decode(value, f"bundle.inclusion_proof.hashes[{index}]", size=32)
        for index, value in enumerate(array(proof["hashes"], "bundle.inclusion_proof.hashes"))
    ]
    certificate, key = _verify_certificate(document["envelope"], trust_root)
    state.update(certificate=certificate, keyid=key.keyid)
    _check_trust_root_copy(document["trust_root"], certificate, trust_root)
    checkpoint = verify_checkpoint(document["checkpoint"], trust_root)
    state["checkpoint"] = checkpoint
    _check_log(
        certificate,
        entry_body(kind, document["envelope"], key.public_key),
        log_index=log_index,
        tree_size=tree_size,
        hashes=hashes,
        checkpoint=checkpoint,
        moment=moment,
    )
    return certificate


def _sigstore_bundle(
    document: Mapping[str, Any], trust_root: TrustRoot, moment: datetime, state: dict[str, Any]
) -> TrainingCertificate:
    envelope, entry = read_sigstore_bundle(document)
    certificate, key = _verify_certificate(envelope, trust_root)
    state.update(certificate=certificate, keyid=key.keyid)
    if not key.has_id(entry.hint):
        raise BundleMismatchError(
            f"verificationMaterial.publicKey.hint names key {entry.hint:.80}, the envelope is "
            f"signed by {key.keyid}"
        )
    checkpoint = verify_checkpoint(entry.checkpoint, trust_root)
    state["checkpoint"] = checkpoint
    expected = entry_body(entry.kind, envelope, key.public_key)  # type: ignore[arg-type]
    if entry.body != expected:
        raise BundleMismatchError(
            f"tlogEntries[0].canonicalizedBody is not the {entry.kind['kind']} "
            f"{entry.kind['version']} log entry of the bundle's dsseEnvelope "
            f"(recomputed from the envelope and key {key.keyid})"
        )
    if entry.log_id != note_key_id(checkpoint.origin, key.public_key):
        raise BundleMismatchError(
            "tlogEntries[0].logId.keyId is not the signed-note key ID of the log's key "
            f"(SHA-256 of {checkpoint.origin!r}, 0x0A, 0x01 and key {key.keyid})"
        )
    if entry.root_hash != checkpoint.root_hash:
        raise BundleMismatchError(
            "tlogEntries[0].inclusionProof.rootHash is not the signed checkpoint's root hash"
        )
    if entry.integrated_time != checkpoint.timestamp:
        raise BundleMismatchError(
            f"tlogEntries[0].integratedTime ({format_time(entry.integrated_time)}) is not the "
            f"signed checkpoint's time ({format_time(checkpoint.timestamp)})"
        )
    if entry.inclusion_promise is not None:
        # The log key is the certificate's key (logId was just checked to name it).
        key.verify(
            entry.inclusion_promise,
            entry.promise_payload(),
            "tlogEntries[0].inclusionPromise (signed entry timestamp)",
        )
        key.check_valid_at(entry.integrated_time, "inclusion promise")
    if entry.timestamps:
        _check_timestamps(entry.timestamps, envelope, certificate, trust_root)
    _check_log(
        certificate,
        entry.body,
        log_index=entry.log_index,
        tree_size=entry.tree_size,
        hashes=entry.hashes,
        checkpoint=checkpoint,
        moment=moment,
    )
    return certificate


def _check_timestamps(
    tokens: Sequence[bytes],
    envelope: object,
    certificate: TrainingCertificate,
    trust_root: TrustRoot,
) -> None:
    # A DVBench trust root names no timestamp authority: the certificate's time is
    # signed by its own key and bounded by the signed checkpoint, and the tokens are
    # checked when the auditor's trust root is the Sigstore trusted root that lists it.
    if not trust_root.timestamp_authorities:
        return
    from dvbench.attest._tsa import verify_timestamp

    signature = _signature_bytes(envelope)
    for index, token in enumerate(tokens):
        what = f"verificationMaterial.timestampVerificationData.rfc3161Timestamps[{index}]"
        moment = verify_timestamp(token, signature, trust_root.timestamp_authorities, what=what)
        if moment != certificate.issued_at:
            raise BundleMismatchError(
                f"{what} stamps the signature at {format_time(moment)}, not at the "
                f"certificate's signed issuedOn {format_time(certificate.issued_at)}"
            )


def _signature_bytes(envelope: object) -> bytes:
    from dvbench.attest._dsse import decode_envelope

    return decode_envelope(envelope)[2][0][1]


def verify_bundle(
    bundle: Mapping[str, Any] | bytes | str,
    trust_root: TrustRoot,
    *,
    transcript_path: str | os.PathLike[str] | None = None,
    model_path: str | os.PathLike[str] | None = None,
    now: datetime | None = None,
) -> BundleVerification:
    """Verify a report bundle or a Sigstore bundle offline; never raises for bad data.

    The format is read from the document: a ``mediaType`` field makes it a Sigstore
    bundle (``dvbench.attest._sigstore``), anything else is read as a report bundle.
    Checks, in order: the bundle's shape; the certificate's DSSE signature by a key of
    ``trust_root``, valid at the certificate's signed ``issuedOn``; the certificate's
    schema; (report bundles) that the bundle's trust root is the one the certificate
    names and agrees with ``trust_root``; (Sigstore bundles) that the key hint, the log
    leaf, the log id, the root hash and the integrated time agree with the verified
    envelope and checkpoint; the checkpoint's signature, by a key valid at its
    timestamp; that checkpoint and certificate name the same log and the proof the same
    entry; the inclusion of the envelope's leaf under the checkpoint's root; that the
    certificate precedes the checkpoint and neither lies in the future; with
    ``transcript_path``, that the transcript verifies and its digest (and the file's
    SHA-256, when the certificate binds one) is the subject's; with ``model_path``, that
    each model file's SHA-256 and the ``model.sig`` beside it are what the certificate binds.

    Args:
        bundle: the bundle as parsed JSON, or its JSON bytes or text.
        trust_root: the auditor's trust root (never the bundle's own copy).
        transcript_path: a proof directory or ``records.cborl`` to compare.
        model_path: a model file, or a folder of ``.safetensors`` files and ``model.sig``.
        now: the verifier's clock (default: the system clock).

    Returns:
        The outcome, with the reason for a failure.
    """
    moment = to_seconds(now if now is not None else datetime.now(UTC))
    state: dict[str, Any] = {}
    checked = False
    model_checked: list[str] = []
    try:
        data = parse_json(bundle, "bundle") if isinstance(bundle, bytes | str) else bundle
        if isinstance(data, Mapping) and "mediaType" in data:
            certificate = _sigstore_bundle(data, trust_root, moment, state)
        else:
            certificate = _report_bundle(data, trust_root, moment, state)
        if transcript_path is not None:
            _check_transcript(certificate, transcript_path)
            checked = True
        if model_path is not None:
            model_checked = _check_model(certificate, model_path)
    except AttestationError as error:
        return BundleVerification(
            ok=False,
            reason=error.reason,
            message=error.message,
            certificate=state.get("certificate"),
            checkpoint=state.get("checkpoint"),
            keyid=state.get("keyid"),
        )
    return BundleVerification(
        ok=True,
        certificate=certificate,
        checkpoint=state["checkpoint"],
        keyid=state["keyid"],
        transcript_checked=checked,
        model_checked=tuple(model_checked),
    )
