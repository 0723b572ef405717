"""The API's errors, and the one format every error response has.

Every error is an :class:`~rest_framework.exceptions.APIException` subclass carrying its
HTTP status and a stable machine ``code``; views raise, and :func:`exception_handler`
renders::

    {"error": {"code": "part_digest_mismatch",
               "message": "part 2: expected sha256 ab12…, got 9f3c…",
               "field": "X-Part-SHA256",
               "detail": {"expected": "ab12…", "got": "9f3c…"}},
     "request_id": "5b0e…"}

``field`` names the request field, header or transcript field at fault (or is null);
``detail`` carries machine-readable particulars (or is null).

Tree::

    APIException (DRF)
    └── DVBenchError
        ├── InvalidRequestError (400)        invalid, invalid_filter, empty_part, …
        │   ├── DigestMismatchError          part_digest_mismatch / blob_digest_mismatch
        │   ├── RoleNotAllowedError          role_not_allowed
        │   └── TooDeepError                 too_deep
        ├── NotFoundError (404)              not_found, does_not_exist
        ├── ConflictError (409)
        │   ├── UploadNotOpenError           upload_not_open
        │   ├── MissingPartsError            missing_parts / size_mismatch (at completion)
        │   ├── SizeExceededError            size_exceeded
        │   ├── LastAdminError               last_admin
        │   ├── RegulatorConflictError       regulator_conflict
        │   ├── AgencyMembersError           agency_members
        │   ├── InvitationRequiredError      invitation_required
        │   ├── AlreadyMemberError           already_member
        │   ├── InvitationClosedError        invitation_closed
        │   └── TooManyProofsError           too_many_proofs
        ├── LengthRequiredError (411)        length_required
        ├── PayloadTooLargeError (413)       part_too_large / blob_too_large
        └── TranscriptRejectedError (422)    experiment_mismatch / spec_mismatch /
                                             framework_mismatch / experiment_missing
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger(__name__)


class DVBenchError(exceptions.APIException):
    """Base of the platform's own errors.

    Args:
        message: Human-readable sentence; defaults to ``default_detail``.
        code: Machine code; defaults to ``default_code``.
        field: The request field or header at fault.
        detail: Machine-readable particulars (expected and got values, limits).
    """

    status_code: int = status.HTTP_400_BAD_REQUEST
    default_detail = "The request could not be processed."
    default_code = "invalid"

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        field: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message or self.default_detail, code or self.default_code)
        self.error_code = code or self.default_code
        self.field = field
        self.extra = detail


class InvalidRequestError(DVBenchError):
    default_detail = "The request is invalid."
    default_code = "invalid"


class DigestMismatchError(InvalidRequestError):
    default_code = "digest_mismatch"

    def __init__(self, what: str, expected: str, got: str, *, code: str, field: str) -> None:
        super().__init__(
            f"{what}: expected sha256 {expected}, got {got}",
            code=code,
            field=field,
            detail={"expected": expected, "got": got},
        )


class RoleNotAllowedError(InvalidRequestError):
    """A role the organisation's kind does not have (regulator in a lab, say)."""

    default_code = "role_not_allowed"


class TooDeepError(InvalidRequestError):
    """JSON nested deeper than any request of this API needs."""

    default_code = "too_deep"


class NotFoundError(DVBenchError):
    status_code = status.HTTP_404_NOT_FOUND
    default_detail = "Not found."
    default_code = "not_found"


class ConflictError(DVBenchError):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class UploadNotOpenError(ConflictError):
    default_code = "upload_not_open"


class MissingPartsError(ConflictError):
    """Completion of an upload whose parts are not all there yet: send them, then retry."""

    default_code = "missing_parts"


class SizeExceededError(ConflictError):
    """A part that would make the upload larger than its declared size."""

    default_code = "size_exceeded"


class LastAdminError(ConflictError):
    default_code = "last_admin"


class RegulatorConflictError(ConflictError):
    """A regulator joining a lab, or a lab member an agency."""

    default_code = "regulator_conflict"


class AgencyMembersError(ConflictError):
    """An agency's membership is changed through the API (only the operator changes it)."""

    default_code = "agency_members"


class InvitationRequiredError(ConflictError):
    """Someone who is not a member joins only by accepting an invitation."""

    default_code = "invitation_required"


class AlreadyMemberError(ConflictError):
    default_code = "already_member"


class InvitationClosedError(ConflictError):
    """An invitation already accepted, declined, revoked or expired."""

    default_code = "invitation_closed"


class TooManyProofsError(ConflictError):
    """The experiment holds as many proofs as ``DVBENCH_MAX_PROOFS_PER_EXPERIMENT`` allows."""

    default_code = "too_many_proofs"


class LengthRequiredError(DVBenchError):
    status_code = status.HTTP_411_LENGTH_REQUIRED
    default_detail = "Send the part with a Content-Length header (chunked bodies are not accepted)."
    default_code = "length_required"


class PayloadTooLargeError(DVBenchError):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "too_large"


class TranscriptRejectedError(DVBenchError):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "The transcript was rejected."
    default_code = "transcript_rejected"


def _first_error(detail: Any, path: str = "") -> tuple[str | None, str, str]:
    """Walk DRF's nested ValidationError detail to its first leaf: (field, message, code)."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            field, message, code = _first_error(
                value, f"{path}.{name}" if path and name else name or path
            )
            return field, message, code
        return path or None, "Invalid input.", "invalid"
    if isinstance(detail, list) and detail:
        first = detail[0]
        if isinstance(first, (dict, list)):
            return _first_error(first, path)
        return path or None, str(first), getattr(first, "code", "invalid") or "invalid"
    return path or None, str(detail), getattr(detail, "code", "invalid") or "invalid"


def error_body(
    code: str, message: str, *, field: str | None, detail: Any, request_id: str | None
) -> dict[str, Any]:
    return {
        "error": {"code": code, "message": message, "field": field, "detail": detail},
        "request_id": request_id,
    }


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler (for status and headers), then the body rewritten into our format."""
    if isinstance(exc, Http404):
        exc = NotFoundError()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, DataError):
        # The database refused a value taken from the request (a NUL character in text, a
        # number out of a column's range) in a lookup no validator covered: the request's
        # fault. The database's message is not echoed (it may quote SQL).
        log.warning("database refused a request value: %s", exc)
        exc = InvalidRequestError(
            "A value in the request cannot be stored or looked up (NUL characters and "
            "out-of-range numbers are not accepted).",
            code="invalid_value",
        )
    elif isinstance(exc, RecursionError):
        # Input nested deeper than anything walking it expected; the parser bounds JSON
        # bodies, this catches any other path (a query value decoded into a structure).
        exc = TooDeepError(
            "A value in the request is nested too deeply to be processed.", field="body"
        )
    elif isinstance(exc, OverflowError):
        # A number past what the database can bind (SQLite: 2**63) in a lookup no validator
        # bounded: the request's fault, like DataError above.
        log.warning("a request value overflowed: %s", exc)
        exc = InvalidRequestError(
            "A number in the request is out of the range that can be stored or looked up.",
            code="invalid_value",
        )
    elif isinstance(exc, DjangoValidationError):
        # A model field refusing a value the URL or filter let through (a malformed UUID
        # in a path): the request is wrong, not the server.
        exc = InvalidRequestError(" ".join(exc.messages) or None, detail={"errors": exc.messages})
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    request = context.get("request")
    request_id = getattr(request, "request_id", None) if request is not None else None
    if isinstance(exc, DVBenchError):
        body = error_body(
            exc.error_code,
            str(exc.detail),
            field=exc.field,
            detail=exc.extra,
            request_id=request_id,
        )
    elif isinstance(exc, exceptions.ValidationError):
        field, message, code = _first_error(exc.detail)
        message = f"{field}: {message}" if field else message
        body = error_body(
            code, message, field=field, detail=exc.get_full_details(), request_id=request_id
        )
    elif isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else exc.default_code
        body = error_body(
            str(code), str(exc.detail), field=None, detail=None, request_id=request_id
        )
    else:  # pragma: no cover - DRF only handles APIException subclasses
        return response
    response.data = body
    return response
