"""Errors raised by the dvbench SDK, and the HTTP statuses they stand for.

Tree::

    DVBenchError
    ├── ConfigurationError            no base URL or API key, a bad DVBENCH_* value
    ├── NetworkError                  connection failed or timed out after every retry
    ├── APIError                      the platform answered with an error status
    │   ├── BadRequestError           400, 413, 422 (a field, digest or transcript at fault)
    │   ├── AuthenticationError       401: missing, unknown, expired or revoked key
    │   ├── PermissionDeniedError     403: the key's role may not do this
    │   ├── NotFoundError             404: absent, or in an organisation the key cannot see
    │   ├── ConflictError             409: e.g. an upload that is no longer open
    │   ├── RateLimitError            429 after every retry
    │   └── ServerError               5xx after every retry
    ├── UploadError                   an upload could not finish; the proof stays on disk
    └── CertificateFailedError        waited for the verdict: FAILED (or a verifier error),
                                      or none came in time (``finish(wait=True)``)

Every :class:`APIError` carries what the platform said (its error body is
``{"error": {"code", "message", "field", "detail"}, "request_id"}``): ``status_code``,
``code``, ``message``, ``field``, ``detail`` and ``request_id`` (quote it when you report
a problem: it finds the request in the platform's logs). Branch on the class::

    try:
        experiment = client.experiment("acme/run-7")
    except dvbench.NotFoundError:
        ...
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "CertificateFailedError",
    "ConfigurationError",
    "ConflictError",
    "DVBenchError",
    "NetworkError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServerError",
    "UploadError",
]


class DVBenchError(Exception):
    """Base class of every error this SDK raises."""


class ConfigurationError(DVBenchError):
    """The SDK is not configured well enough to run (no base URL, no key, a bad setting)."""


class NetworkError(DVBenchError):
    """The platform could not be reached, or stopped answering, after every retry.

    Attributes:
        attempts: how many times the request was tried.
    """

    def __init__(self, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class CertificateFailedError(DVBenchError):
    """The proof's certificate records FAILED, the verifier failed, or no verdict came in time.

    Raised by ``finish(wait=True)`` and :meth:`Client.wait_for_verdict` with
    ``raise_on_failure=True``: a script that waits for its verdict stops here instead of
    reporting success. The proof itself is filed; nothing is lost.

    Attributes:
        verdict: the :class:`~dvbench.Verdict` (``state`` FAILED, error or pending; for
            FAILED, ``failed`` lists the failed claims).
    """

    def __init__(self, message: str, *, verdict: Any) -> None:
        super().__init__(message)
        self.verdict = verdict


class UploadError(DVBenchError):
    """An upload did not finish. Nothing is lost: the proof directory is kept.

    Attributes:
        directory: where the proof and its upload state are kept.
    """

    def __init__(self, message: str, *, directory: str | None = None) -> None:
        super().__init__(message)
        self.directory = directory


class APIError(DVBenchError):
    """The platform answered with an error status.

    Attributes:
        status_code: the HTTP status.
        code: the platform's machine-readable error code (``part_digest_mismatch``, ...).
        message: the platform's sentence, followed by what to do about it.
        field: the request field, header or transcript field at fault, or None.
        detail: machine-readable particulars (expected and got values, limits), or None.
        request_id: the platform's id of the request (``X-Request-ID``).
        response: the :class:`httpx.Response`, when there was one.
    """

    #: What a user can do about errors of this class, appended to the message.
    hint: str = ""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str | None = None,
        field: str | None = None,
        detail: Any = None,
        request_id: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        self.status_code = status_code
        self.code = code
        self.message = message
        self.field = field
        self.detail = detail
        self.request_id = request_id
        self.response = response
        text = f"{status_code} {code or 'error'}: {message}"
        if self.hint:
            text += f" ({self.hint})"
        if request_id:
            text += f" [request_id={request_id}]"
        super().__init__(text)


class BadRequestError(APIError):
    """400, 413 or 422: the request (or the transcript) is wrong; ``field`` says where."""


class AuthenticationError(APIError):
    """401: the API key is missing, unknown, expired or revoked."""

    hint = "check DVBENCH_API_KEY or run `dvbench login`"


class PermissionDeniedError(APIError):
    """403: the key's role in the organisation does not allow this."""

    hint = "ask an admin of the organisation for the trainer role, or use another key"


class NotFoundError(APIError):
    """404: no such object, or it belongs to an organisation the key cannot see."""

    hint = "check the name, and that the key belongs to a member of the owning organisation"


class ConflictError(APIError):
    """409: the object is not in a state that allows this (e.g. a closed upload)."""


class RateLimitError(APIError):
    """429 after every retry: the platform asks the client to slow down."""

    hint = "retry later, or raise DVBENCH_MAX_RETRIES"


class ServerError(APIError):
    """5xx after every retry: the platform failed; the request may be retried later."""

    hint = "the platform failed; retry later and quote the request_id if it persists"


def error_class(status_code: int) -> type[APIError]:
    """The :class:`APIError` subclass for an HTTP error status."""
    if status_code == 401:
        return AuthenticationError
    if status_code == 403:
        return PermissionDeniedError
    if status_code == 404:
        return NotFoundError
    if status_code == 409:
        return ConflictError
    if status_code == 429:
        return RateLimitError
    if status_code >= 500:
        return ServerError
    return BadRequestError


def from_response(response: httpx.Response) -> APIError:
    """Build the error for an error response, reading the platform's error envelope.

    A body that is not the platform's envelope (a proxy's HTML page, an empty body) still
    gives an error of the right class, with the status line as its message.
    """
    code: str | None = None
    field: str | None = None
    detail: Any = None
    message = ""
    request_id = response.headers.get("X-Request-ID")
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            code = _str_or_none(error.get("code"))
            message = str(error.get("message") or "")
            field = _str_or_none(error.get("field"))
            detail = error.get("detail")
        request_id = _str_or_none(body.get("request_id")) or request_id
    if not message:
        message = f"{response.reason_phrase or 'error'} ({response.request.method} {response.request.url.path})"
    cls = error_class(response.status_code)
    return cls(
        message,
        status_code=response.status_code,
        code=code,
        field=field,
        detail=detail,
        request_id=request_id,
        response=response,
    )


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
