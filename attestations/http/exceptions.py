"""Where the platform's errors meet HTTP: one status per kind, and one error body.

Models and services raise the domain errors of ``attestations.core.errors`` (and each
app's ``errors.py``), which know nothing of HTTP. :data:`STATUS_CODES` is the one place a
kind of error gets its status, and :func:`exception_handler` (DRF's
``EXCEPTION_HANDLER``) renders every error, ours and DRF's, as::

    {"error": {"code", "message", "field", "detail"}, "request_id"}

Tree (the status is the kind's; the codes are examples)::

    DVBenchError (attestations.core.errors)
    ├── InvalidRequestError (400)        invalid, invalid_filter, unknown_filter, empty_part, …
    │   ├── DigestMismatchError          part_digest_mismatch / blob_digest_mismatch
    │   ├── RoleNotAllowedError          role_not_allowed
    │   ├── ArtifactRejectedError        invalid_name, duplicate_name, blob_not_found, …
    │   └── TooDeepError                 too_deep
    ├── NotFoundError (404)              not_found, does_not_exist, invalid_cursor
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
    │   ├── TooManyProofsError           too_many_proofs
    │   └── ArtifactConflictError        artifact_conflict
    ├── LengthRequiredError (411)        length_required
    ├── PayloadTooLargeError (413)       part_too_large / blob_too_large
    ├── UnprocessableError (422)
    │   ├── TranscriptRejectedError      experiment_mismatch / spec_mismatch /
    │   │                                framework_mismatch / experiment_missing
    │   └── ArtifactMismatchError        program_mismatch, snapshot_mismatch, …
    └── UnavailableError (503)           signing_unavailable
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from attestations.core.errors import (
    ConflictError,
    DVBenchError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    UnavailableError,
    UnprocessableError,
)

log = logging.getLogger(__name__)


class LengthRequiredError(DVBenchError):
    """A request body of unknown length (chunked) where the API needs its length first."""

    default_message = (
        "Send the part with a Content-Length header (chunked bodies are not accepted)."
    )
    default_code = "length_required"


class TooDeepError(InvalidRequestError):
    """JSON nested deeper than any request of this API needs."""

    default_code = "too_deep"


#: The HTTP status of each kind of domain error, most specific first: the one place a
#: domain error meets HTTP. A kind not listed (the bare base) is a 400.
STATUS_CODES: tuple[tuple[type[DVBenchError], int], ...] = (
    (InvalidRequestError, status.HTTP_400_BAD_REQUEST),
    (NotFoundError, status.HTTP_404_NOT_FOUND),
    (ConflictError, status.HTTP_409_CONFLICT),
    (LengthRequiredError, status.HTTP_411_LENGTH_REQUIRED),
    (PayloadTooLargeError, status.HTTP_413_REQUEST_ENTITY_TOO_LARGE),
    (UnprocessableError, status.HTTP_422_UNPROCESSABLE_ENTITY),
    (UnavailableError, status.HTTP_503_SERVICE_UNAVAILABLE),
)


def status_of(error: type[DVBenchError]) -> int:
    """The HTTP status of a kind of domain error (:data:`STATUS_CODES`)."""
    for kind, code in STATUS_CODES:
        if issubclass(error, kind):
            return code
    return status.HTTP_400_BAD_REQUEST


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
    """Render every error in the one format.

    Domain errors get the status of their kind (:func:`status_of`); DRF's own errors go
    through DRF's handler (for their status and headers) and have their body rewritten.
    Django's and the database's errors that can only be the request's fault become
    domain errors first.
    """
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
    request = context.get("request")
    request_id = getattr(request, "request_id", None) if request is not None else None
    if request is not None:
        # An error is JSON whatever the client asked for (Accept: text/html, ?format=api):
        # the browsable API would render it as an HTML page, and a client parsing errors
        # must find the one format. The view's finalize_response takes this renderer.
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    if isinstance(exc, DVBenchError):
        # As DRF does for the errors it handles: a view's atomic block is rolled back.
        set_rollback()
        body = error_body(
            exc.error_code, exc.message, field=exc.field, detail=exc.detail, request_id=request_id
        )
        return Response(body, status=status_of(type(exc)))
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
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
