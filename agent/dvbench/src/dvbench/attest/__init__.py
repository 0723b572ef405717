"""dvbench.attest: signed training certificates that anyone can verify offline.

The framework-free cryptographic core of DVBench's attestations; the platform issues
with it and ``dvbench verify-report`` checks with it, on a laptop with no network:

* DSSE v1 envelopes (:func:`pae`, :func:`sign_envelope`, :func:`verify_envelope`);
* in-toto Statement v1 and the training certificate predicate
  (:class:`Statement`, :class:`TrainingCertificate`; schema in ``docs/certificates.md``);
* Ed25519 keys with SPKI key ids and a versioned :class:`TrustRoot` whose keys rotate
  with validity windows, judged at the signed time;
* the RFC 9162 transparency log's Merkle math and C2SP-style signed checkpoints;
* the offline report bundle (:func:`make_bundle`, :func:`verify_bundle`), and the same
  certificate as a Sigstore bundle v0.3 (:func:`make_sigstore_bundle`; ``verify_bundle``
  reads both), whose log entry is a Rekor ``dsse`` entry (:func:`dsse_entry_body`) with
  the log's signed entry timestamp and an RFC 3161 timestamp (:func:`verify_timestamp`);
* the trust root in Sigstore's TrustedRoot format (:func:`sigstore_trusted_root`, read
  back by :meth:`TrustRoot.from_sigstore`);
* the log key as a C2SP signed-note verifier key (:func:`note_verifier_key`);
* the encodings everything above signs: :func:`canonical_json` (also the platform's
  spec digests) and RFC 3339 whole-second times (:func:`format_time`,
  :func:`parse_time`, :func:`to_seconds`).

A round trip::

    key = load_signing_key(data_dir=".data")
    root = TrustRoot.initial(key.public_key, not_before=start)
    envelope = sign_certificate(certificate, key)
    tree.append(envelope_leaf_hash(envelope))
    note = sign_checkpoint(Checkpoint(origin, tree.size, tree.root(), now), key)
    bundle = make_bundle(envelope, log_index=i, inclusion_proof=tree.inclusion_proof(i),
                         checkpoint=note, tree_size=tree.size, trust_root=root)
    assert verify_bundle(bundle, root).ok

Errors form one tree under :class:`AttestationError` (see ``dvbench.attest._errors``).
"""

from __future__ import annotations

from dvbench.attest._bundle import (
    BUNDLE_FORMAT,
    MAX_CLOCK_SKEW,
    BundleVerification,
    envelope_leaf,
    envelope_leaf_hash,
    make_bundle,
    sign_certificate,
    verify_bundle,
    verify_certificate,
)
from dvbench.attest._certificate import (
    DIGEST_STATE_ROOT,
    DIGEST_TRANSCRIPT,
    PREDICATE_TYPE_TRAINING,
    SUBJECT_MODEL_SIGNING_PREFIX,
    SUBJECT_PARAMETERS,
    SUBJECT_TRANSCRIPT,
    SUBJECT_TRANSCRIPT_FILE,
    Claim,
    Evidence,
    LogEntryRef,
    ReplayEvidence,
    Result,
    TrainingCertificate,
)
from dvbench.attest._dsse import (
    PAYLOAD_TYPE_INTOTO,
    Envelope,
    EnvelopeSignature,
    pae,
    sign_envelope,
    verify_envelope,
)
from dvbench.attest._encoding import canonical_json, format_time, parse_time, to_seconds
from dvbench.attest._errors import (
    AttestationError,
    BundleMismatchError,
    InvalidProofError,
    InvalidSignatureError,
    KeyConfigurationError,
    KeyNotValidError,
    MalformedInputError,
    SubjectMismatchError,
    UnknownKeyError,
)
from dvbench.attest._filings import Filing, Filings, RunFiling, RunFilings
from dvbench.attest._intoto import DIGEST_SHA256, STATEMENT_TYPE, Statement, Subject
from dvbench.attest._keys import (
    ALGORITHM_ED25519,
    DEFAULT_KEY_FILENAME,
    ENV_SIGNING_KEY,
    TRUST_ROOT_SCHEMA,
    Signer,
    SigningKey,
    TrustedKey,
    TrustRoot,
    key_id,
    key_ids,
    load_signing_key,
    spki_key_id,
)
from dvbench.attest._model_signing import (
    MODEL_SIGNATURE_FILE,
    PREDICATE_TYPE_MODEL_SIGNING,
    model_signature_subject,
)
from dvbench.attest._note import note_key_id, note_verifier_key, parse_note_verifier_key
from dvbench.attest._rekor import (
    DSSE_KIND,
    LEGACY_KIND,
    dsse_entry_body,
    entry_body,
    entry_kind,
    inclusion_promise_payload,
)
from dvbench.attest._sigstore import (
    SIGSTORE_BUNDLE_MEDIA_TYPE,
    SIGSTORE_ENTRY_KIND,
    make_sigstore_bundle,
)
from dvbench.attest._translog import (
    EMPTY_ROOT,
    Checkpoint,
    MerkleTree,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_hash,
    sign_checkpoint,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from dvbench.attest._trusted_root import TRUSTED_ROOT_MEDIA_TYPE, sigstore_trusted_root
from dvbench.attest._tsa import TimestampAuthority, verify_timestamp

__all__ = [
    "ALGORITHM_ED25519",
    "BUNDLE_FORMAT",
    "DEFAULT_KEY_FILENAME",
    "DIGEST_SHA256",
    "DIGEST_STATE_ROOT",
    "DIGEST_TRANSCRIPT",
    "DSSE_KIND",
    "EMPTY_ROOT",
    "ENV_SIGNING_KEY",
    "LEGACY_KIND",
    "MAX_CLOCK_SKEW",
    "MODEL_SIGNATURE_FILE",
    "PAYLOAD_TYPE_INTOTO",
    "PREDICATE_TYPE_MODEL_SIGNING",
    "PREDICATE_TYPE_TRAINING",
    "SIGSTORE_BUNDLE_MEDIA_TYPE",
    "SIGSTORE_ENTRY_KIND",
    "STATEMENT_TYPE",
    "SUBJECT_MODEL_SIGNING_PREFIX",
    "SUBJECT_PARAMETERS",
    "SUBJECT_TRANSCRIPT",
    "SUBJECT_TRANSCRIPT_FILE",
    "TRUSTED_ROOT_MEDIA_TYPE",
    "TRUST_ROOT_SCHEMA",
    "AttestationError",
    "BundleMismatchError",
    "BundleVerification",
    "Checkpoint",
    "Claim",
    "Envelope",
    "EnvelopeSignature",
    "Evidence",
    "Filing",
    "Filings",
    "InvalidProofError",
    "InvalidSignatureError",
    "KeyConfigurationError",
    "KeyNotValidError",
    "LogEntryRef",
    "MalformedInputError",
    "MerkleTree",
    "ReplayEvidence",
    "Result",
    "RunFiling",
    "RunFilings",
    "Signer",
    "SigningKey",
    "Statement",
    "Subject",
    "SubjectMismatchError",
    "TimestampAuthority",
    "TrainingCertificate",
    "TrustRoot",
    "TrustedKey",
    "UnknownKeyError",
    "canonical_json",
    "consistency_proof",
    "dsse_entry_body",
    "entry_body",
    "entry_kind",
    "envelope_leaf",
    "envelope_leaf_hash",
    "format_time",
    "inclusion_promise_payload",
    "inclusion_proof",
    "key_id",
    "key_ids",
    "leaf_hash",
    "load_signing_key",
    "make_bundle",
    "make_sigstore_bundle",
    "model_signature_subject",
    "node_hash",
    "note_key_id",
    "note_verifier_key",
    "pae",
    "parse_note_verifier_key",
    "parse_time",
    "root_hash",
    "sign_certificate",
    "sign_checkpoint",
    "sign_envelope",
    "sigstore_trusted_root",
    "spki_key_id",
    "to_seconds",
    "verify_bundle",
    "verify_certificate",
    "verify_checkpoint",
    "verify_consistency",
    "verify_envelope",
    "verify_inclusion",
    "verify_timestamp",
]
