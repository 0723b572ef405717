"""Errors of resumable uploads (kinds: ``attestations.core.errors``)."""

from __future__ import annotations

from attestations.core.errors import ConflictError, InvalidRequestError


class DigestMismatchError(InvalidRequestError):
    """Bytes that do not hash to the SHA-256 declared for them (a part, or the whole)."""

    default_code = "digest_mismatch"

    def __init__(self, what: str, expected: str, got: str, *, code: str, field: str) -> None:
        super().__init__(
            f"{what}: expected sha256 {expected}, got {got}",
            code=code,
            field=field,
            detail={"expected": expected, "got": got},
        )


class UploadNotOpenError(ConflictError):
    default_code = "upload_not_open"


class MissingPartsError(ConflictError):
    """Completion of an upload whose parts are not all there yet: send them, then retry."""

    default_code = "missing_parts"


class SizeExceededError(ConflictError):
    """A part that would make the upload larger than its declared size."""

    default_code = "size_exceeded"
