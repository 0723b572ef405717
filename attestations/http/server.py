"""Gunicorn workers that answer gunicorn's own refusals in the API's error format.

Gunicorn refuses some requests before the application sees them: a request line over
``limit_request_line`` (4094 bytes), headers over their limits, a ``Content-Length`` that
is not a number, a malformed request line or header. Its answer is an HTML page; every
other error of the platform is the one JSON document::

    {"error": {"code", "message", "field", "detail"}, "request_id"}

:class:`JsonErrorSyncWorker` (and :class:`JsonErrorThreadWorker`, for
``--worker-class gthread`` setups) keeps gunicorn's limits and statuses and writes that
document instead, with an ``X-Request-ID`` header, as the application would
(``platform/gunicorn.conf.py`` selects it). Errors gunicorn does not classify as the
client's (a crash outside the application) keep gunicorn's own handling.

This module is imported by gunicorn's master process before Django is set up, so it
imports only gunicorn and the standard library; its body is ``error_body``'s
(``attestations/http/exceptions.py``), which a test checks.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from gunicorn.http import errors
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker

#: ``(kind of gunicorn error, status, reason phrase, code)``, most specific first. The
#: statuses are gunicorn's own for each kind.
REFUSALS: tuple[tuple[type[Exception], int, str, str], ...] = (
    (errors.LimitRequestLine, 414, "URI Too Long", "uri_too_long"),
    (errors.LimitRequestHeaders, 431, "Request Header Fields Too Large", "headers_too_large"),
    (errors.InvalidHeaderName, 400, "Bad Request", "invalid_header"),
    (errors.InvalidHeader, 400, "Bad Request", "invalid_header"),
    (errors.InvalidRequestLine, 400, "Bad Request", "invalid_request_line"),
    (errors.InvalidRequestMethod, 400, "Bad Request", "invalid_method"),
    (errors.InvalidHTTPVersion, 400, "Bad Request", "invalid_http_version"),
    (errors.ObsoleteFolding, 400, "Bad Request", "invalid_header"),
    (errors.InvalidChunkSize, 400, "Bad Request", "invalid_chunk"),
    (errors.ChunkMissingTerminator, 400, "Bad Request", "invalid_chunk"),
    (errors.InvalidChunkExtension, 400, "Bad Request", "invalid_chunk"),
    (errors.UnsupportedTransferCoding, 501, "Not Implemented", "unsupported_transfer_coding"),
    (errors.ExpectationFailed, 417, "Expectation Failed", "expectation_failed"),
    (errors.InvalidProxyLine, 400, "Bad Request", "invalid_proxy_line"),
    (errors.ForbiddenProxyRequest, 403, "Forbidden", "forbidden"),
    (errors.InvalidSchemeHeaders, 400, "Bad Request", "invalid_header"),
)


def describe(exc: Exception, code: str) -> tuple[str, str | None, dict[str, Any] | None]:
    """The message, field and detail for one of gunicorn's refusals."""
    if isinstance(exc, errors.LimitRequestLine):
        size = exc.size
        limit = exc.max_size
        message = (
            f"The request line is over the limit of {limit} bytes; put long parameters in a "
            "request body."
            if limit is not None
            else f"The request line is over the limit of {size} bytes."
        )
        return message, "path", {"limit": limit if limit is not None else size}
    if isinstance(exc, errors.LimitRequestHeaders):
        return f"The request headers are over the server's limits ({exc.msg}).", None, None
    if isinstance(exc, errors.InvalidHeader):
        name = str(exc.hdr)
        if name.upper() == "CONTENT-LENGTH":
            return (
                "Content-Length must be a single whole number of bytes.",
                "Content-Length",
                None,
            )
        name = name.title()
        return f"The header {name} is malformed.", name, None
    if isinstance(exc, errors.InvalidHeaderName):
        return "A header name is malformed.", None, None
    return f"The request cannot be read: {exc}.", None, None


def error_document(status: int, reason: str, code: str, exc: Exception) -> tuple[bytes, str]:
    """The full HTTP response for a refusal, and its request id."""
    message, field, detail = describe(exc, code)
    request_id = uuid.uuid4().hex
    body = json.dumps(
        {
            "error": {"code": code, "message": message, "field": field, "detail": detail},
            "request_id": request_id,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"X-Request-ID: {request_id}\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body, request_id


class JsonErrorsMixin:
    """Answer gunicorn's client-error refusals with the API's JSON error document."""

    def handle_error(self, req: Any, client: Any, addr: Any, exc: Exception) -> None:
        refusal = next((r for r in REFUSALS if isinstance(exc, r[0])), None)
        if refusal is None:
            super().handle_error(req, client, addr, exc)  # type: ignore[misc]
            return
        _, status, reason, code = refusal
        response, request_id = error_document(status, reason, code, exc)
        ip = (addr or ("", -1))[0]
        self.log.warning(  # type: ignore[attr-defined]
            "Invalid request from ip=%s: %s (%d %s, request %s)", ip, exc, status, code, request_id
        )
        try:
            client.sendall(response)
        except OSError:
            self.log.debug("Failed to send error message.")  # type: ignore[attr-defined]


class JsonErrorSyncWorker(JsonErrorsMixin, SyncWorker):  # type: ignore[misc]  # gunicorn: untyped
    """Gunicorn's default (sync) worker, with JSON refusals."""


class JsonErrorThreadWorker(JsonErrorsMixin, ThreadWorker):  # type: ignore[misc]  # gunicorn: untyped
    """Gunicorn's gthread worker, with JSON refusals."""


__all__ = ["REFUSALS", "JsonErrorSyncWorker", "JsonErrorThreadWorker"]
