"""Errors raised by :mod:`dvbench.attest`.

Tree::

    AttestationError                 base; carries a stable ``reason`` code
    ├── MalformedInputError          a document does not parse or breaks its schema (also ValueError)
    ├── KeyConfigurationError        no signing key could be loaded or generated
    ├── UnknownKeyError              a key id that the trust root does not list
    ├── KeyNotValidError             a trusted key used outside its validity window
    ├── InvalidSignatureError        no trusted key's signature verifies
    ├── InvalidProofError            a Merkle inclusion or consistency proof does not verify
    ├── BundleMismatchError          verified parts of a bundle disagree with each other
    └── SubjectMismatchError         a local file's digest is not the certificate's subject

Branch on the class, or read ``error.reason`` (one code per class, listed on each) when
the error must travel as data, as :class:`~dvbench.attest.BundleVerification` does.
"""

from __future__ import annotations

__all__ = [
    "AttestationError",
    "BundleMismatchError",
    "InvalidProofError",
    "InvalidSignatureError",
    "KeyConfigurationError",
    "KeyNotValidError",
    "MalformedInputError",
    "SubjectMismatchError",
    "UnknownKeyError",
]


class AttestationError(Exception):
    """Base of every error :mod:`dvbench.attest` raises on purpose.

    Attributes:
        reason: a stable machine-readable code, e.g. ``"bad_signature"``.
    """

    reason = "attestation_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedInputError(AttestationError, ValueError):
    """A document (envelope, statement, proof, checkpoint, trust root, bundle) is malformed."""

    reason = "malformed"


class KeyConfigurationError(AttestationError):
    """No signing key could be loaded from the configured file, variable or directory."""

    reason = "key_configuration"


class UnknownKeyError(AttestationError):
    """A signature names a key id that the trust root does not list."""

    reason = "unknown_key"


class KeyNotValidError(AttestationError):
    """A trusted key signed at a time outside its validity window."""

    reason = "key_not_valid"


class InvalidSignatureError(AttestationError):
    """No signature by a trusted key verifies over the signed bytes."""

    reason = "bad_signature"


class InvalidProofError(AttestationError):
    """A Merkle inclusion or consistency proof does not verify."""

    reason = "bad_proof"


class BundleMismatchError(AttestationError):
    """Individually valid parts of a bundle disagree (log index, origin, time, trust root)."""

    reason = "bundle_mismatch"


class SubjectMismatchError(AttestationError):
    """A local file's digest differs from the certificate's subject digest."""

    reason = "subject_mismatch"
