"""The public API of dvbench.attest is a deliberate list, and the package stays free of Django."""

from __future__ import annotations

import ast
from pathlib import Path

import dvbench.attest as attest

PACKAGE = Path(attest.__file__).parent

EXPECTED = {
    # constants
    "ALGORITHM_ED25519", "BUNDLE_FORMAT", "DEFAULT_KEY_FILENAME", "DIGEST_STATE_ROOT",
    "DIGEST_TRANSCRIPT", "EMPTY_ROOT", "ENV_SIGNING_KEY", "MAX_CLOCK_SKEW",
    "PAYLOAD_TYPE_INTOTO", "PREDICATE_TYPE_TRAINING", "STATEMENT_TYPE",
    "SUBJECT_PARAMETERS", "SUBJECT_TRANSCRIPT", "TRUST_ROOT_SCHEMA",
    "DIGEST_SHA256", "MODEL_SIGNATURE_FILE", "PREDICATE_TYPE_MODEL_SIGNING",
    "SIGSTORE_BUNDLE_MEDIA_TYPE", "SIGSTORE_ENTRY_KIND", "SUBJECT_MODEL_SIGNING_PREFIX",
    "SUBJECT_TRANSCRIPT_FILE",
    # errors
    "AttestationError", "BundleMismatchError", "InvalidProofError", "InvalidSignatureError",
    "KeyConfigurationError", "KeyNotValidError", "MalformedInputError",
    "SubjectMismatchError", "UnknownKeyError",
    # DSSE
    "Envelope", "EnvelopeSignature", "pae", "sign_envelope", "verify_envelope",
    # in-toto
    "Claim", "Evidence", "Filing", "Filings", "LogEntryRef", "ReplayEvidence", "Result",
    "RunFiling", "RunFilings", "Statement", "Subject", "TrainingCertificate", "model_signature_subject",
    # keys
    "Signer", "SigningKey", "TrustRoot", "TrustedKey", "key_id", "load_signing_key",
    "key_ids", "spki_key_id",
    # Sigstore: Rekor dsse entries, the signed entry timestamp, RFC 3161, the trusted root
    "DSSE_KIND", "LEGACY_KIND", "dsse_entry_body", "entry_body", "entry_kind",
    "inclusion_promise_payload", "TRUSTED_ROOT_MEDIA_TYPE", "sigstore_trusted_root",
    "TimestampAuthority", "verify_timestamp",
    # log
    "Checkpoint", "MerkleTree", "consistency_proof", "inclusion_proof", "leaf_hash",
    "node_hash", "root_hash", "sign_checkpoint", "verify_checkpoint", "verify_consistency",
    "verify_inclusion", "note_key_id", "note_verifier_key", "parse_note_verifier_key",
    # bundle
    "BundleVerification", "envelope_leaf", "envelope_leaf_hash", "make_bundle",
    "sign_certificate", "verify_bundle", "verify_certificate", "make_sigstore_bundle",
    # encodings (the platform's spec digests and certificate times use the same)
    "canonical_json", "format_time", "parse_time", "to_seconds",
}  # fmt: skip


def test_all_is_the_deliberate_list() -> None:
    assert set(attest.__all__) == EXPECTED
    assert attest.__all__ == sorted(attest.__all__, key=lambda name: (not name.isupper(), name))


def test_every_exported_name_exists_and_is_defined_in_a_private_module() -> None:
    for name in attest.__all__:
        value = getattr(attest, name)
        module = getattr(value, "__module__", None)
        if module is not None and module.startswith("dvbench.attest"):
            assert module.split(".")[2].startswith("_"), (name, module)


def test_the_library_modules_are_private() -> None:
    public = {path.name for path in PACKAGE.glob("*.py") if not path.name.startswith("_")}
    # The command, and one internal API: the platform's tests' pre-securesystemslib key
    # ids (``dvbench.attest.legacy``, issue 57), which no user imports.
    assert public == {"cli.py", "legacy.py"}


def test_no_django_import_anywhere_in_the_agent() -> None:
    agent = PACKAGE.parents[3]  # agent/dvbench/src/dvbench/attest
    assert agent.name == "agent"
    offenders = []
    for path in agent.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path}: {name}" for name in names if name.split(".")[0] == "django"]
    assert offenders == []
