"""The OpenSSF model-signing signature the SDK writes beside the final model.

``model_signing`` (1.x) signs a manifest of the model's files as an in-toto statement
inside a Sigstore bundle; the certificate binds that manifest's digest as a subject.
"""

from __future__ import annotations

import base64
import json
from typing import Final

from dvbench.attest._errors import SubjectMismatchError
from dvbench.attest._intoto import DIGEST_SHA256

__all__ = ["MODEL_SIGNATURE_FILE", "PREDICATE_TYPE_MODEL_SIGNING", "model_signature_subject"]

#: Where the SDK writes the model's OpenSSF model-signing signature, beside the weights.
MODEL_SIGNATURE_FILE: Final = "model.sig"
#: The predicate type of an OpenSSF model-signing (``model_signing`` 1.x) statement.
PREDICATE_TYPE_MODEL_SIGNING: Final = "https://model_signing/signature/v1.0"


def model_signature_subject(signature: bytes) -> tuple[str, str]:
    """The model name and manifest digest an OpenSSF model signature (``model.sig``) signs.

    Reads the in-toto statement inside the signature's Sigstore bundle without checking
    its signature: that is ``model_signing verify``'s job; the certificate binds the
    manifest digest, so a signature over another manifest does not match it.

    Raises:
        SubjectMismatchError: the file is not a model_signing signature.
    """
    try:
        bundle = json.loads(signature)
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json.loads(payload)
        if statement.get("predicateType") != PREDICATE_TYPE_MODEL_SIGNING:
            raise ValueError(f"predicateType {statement.get('predicateType')!r}")
        (subject,) = statement["subject"]
        name, digest = subject["name"], subject["digest"][DIGEST_SHA256]
        if not isinstance(name, str) or not isinstance(digest, str):
            raise ValueError("subject name or digest is not a string")
    except (ValueError, KeyError, TypeError) as error:
        raise SubjectMismatchError(f"not an OpenSSF model_signing signature: {error}") from None
    return name, digest
