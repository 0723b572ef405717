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


class IncompleteBodyError(InvalidRequestError):
    """A body that ended before its Content-Length: the client hung up or lied (400)."""

    default_code = "incomplete_body"

    def __init__(self, what: str, expected: int, got: int) -> None:
        super().__init__(
            f"{what}: Content-Length is {expected} bytes but the body ended after {got}; "
            "send it again",
            field="body",
            detail={"expected": expected, "got": got},
        )
