"""The platform's domain errors: what went wrong, in words and in a stable code.

Models and services raise these; they know nothing of HTTP. Each kind of error is a
subclass of :class:`DVBenchError`, and the REST API's exception handler
(``attestations/http/exceptions.py``) is the one place that gives each kind its HTTP
status and renders the one error body::

    {"error": {"code": "part_digest_mismatch",
               "message": "part 2: expected sha256 ab12…, got 9f3c…",
               "field": "X-Part-SHA256",
               "detail": {"expected": "ab12…", "got": "9f3c…"}},
     "request_id": "5b0e…"}

``field`` names the request field, header or transcript field at fault (or is None);
``detail`` carries machine-readable particulars (or is None).

Tree (each app adds its own errors under these kinds, in its ``errors.py``)::

    DVBenchError
    ├── InvalidRequestError        the request is malformed or names an unusable value
    ├── NotFoundError              what the request names does not exist (for the caller)
    ├── ConflictError              the request conflicts with the current state
    ├── PayloadTooLargeError       a body or a declared size past a limit
    ├── UnprocessableError         well-formed, but refused on its content (a transcript,
    │                              a file that does not match its commitment)
    └── UnavailableError           a service the request needs is not usable now
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConflictError",
    "DVBenchError",
    "InvalidRequestError",
    "NotFoundError",
    "PayloadTooLargeError",
    "UnavailableError",
    "UnprocessableError",
]


class DVBenchError(Exception):
    """Base of the platform's own errors.

    Args:
        message: One human-readable sentence; defaults to ``default_message``.
        code: Stable machine code; defaults to ``default_code``.
        field: The request field, header or transcript field at fault.
        detail: Machine-readable particulars (expected and got values, limits).
    """

    default_message = "The request could not be processed."
    default_code = "invalid"

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        field: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.error_code = code or self.default_code
        self.field = field
        self.detail = detail
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(DVBenchError):
    default_message = "The request is invalid."
    default_code = "invalid"


class NotFoundError(DVBenchError):
    default_message = "Not found."
    default_code = "not_found"


class ConflictError(DVBenchError):
    default_message = "The request conflicts with the current state."
    default_code = "conflict"


class PayloadTooLargeError(DVBenchError):
    default_message = "The request body is too large."
    default_code = "too_large"


class UnprocessableError(DVBenchError):
    default_message = "The request was understood but cannot be accepted."
    default_code = "unprocessable"


class UnavailableError(DVBenchError):
    default_message = "A service this request needs is unavailable."
    default_code = "unavailable"
