"""Request ids, security headers, sign-in rate limits, and API errors that escape a view.

* :class:`RequestIDMiddleware`: one id per request, echoed in ``X-Request-ID`` and in every
  error body. Under ``/api/`` an exception no view handled becomes a 500 (400 for a body
  cut short, 413 for one over Django's limit, 507 when storage is full), and a path no route matches a 404, in the
  API's one error format instead of Django's HTML page.
* :class:`SecurityHeadersMiddleware`: headers Django's ``SecurityMiddleware`` does not set
  (``Content-Security-Policy``, ``Permissions-Policy``).
* :class:`PrivateCacheMiddleware`: ``Cache-Control: no-store, private`` on whatever a
  signed-in user is sent, unless the response set its own.
* :class:`LoginRateLimitMiddleware`: failed sign-ins are counted per address and per
  username; past ``DVBENCH_RATE_LIMITS["login_failures"]`` the sign-in pages answer 429
  with ``Retry-After`` without checking the password.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import uuid
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, UnreadablePostError
from django.urls import NoReverseMatch, reverse

from attestations.core.conf import client_ip
from attestations.http.exceptions import error_body
from attestations.http.throttling import count_login_failure, login_wait

REQUEST_ID_HEADER = "X-Request-ID"
# A caller's id is kept only if it is short and plain, so it can be logged and echoed
# without escaping.
_ACCEPTABLE = re.compile(r"^[A-Za-z0-9._:-]{8,64}$")
API_PREFIX = "/api/"
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

log = logging.getLogger("attestations.request")


class RequestIDMiddleware:
    """Attach ``request.request_id`` (the caller's, if acceptable, else a fresh UUID)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = incoming if _ACCEPTABLE.match(incoming) else uuid.uuid4().hex
        request.request_id = request_id  # type: ignore[attr-defined]
        response = self.get_response(request)
        if response.status_code == 404 and request.path.startswith(API_PREFIX):
            response = self._api_not_found(request, response)
        response[REQUEST_ID_HEADER] = request_id
        return response

    @staticmethod
    def _api_not_found(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        """A 404 from outside the API's views (a path no route matches) in the API format."""
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        body = error_body(
            "not_found",
            f"No API endpoint {request.path}; see /api/v1/docs/.",
            field="path",
            detail=None,
            request_id=getattr(request, "request_id", None),
        )
        return JsonResponse(body, status=404)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Render an API exception that no view handled in the one error format.

        DRF renders the exceptions it knows; this catches the rest (a bug, a database
        outage, a body over Django's limit read while parsing) so that an API client
        always gets JSON with a request id it can quote. Web pages keep Django's handling.
        """
        if not request.path.startswith(API_PREFIX):
            return None
        request_id = getattr(request, "request_id", None)
        if isinstance(exception, UnreadablePostError):
            # The client promised more body than it sent (it disconnected, or lied in
            # Content-Length): its fault, and nothing of the body was kept.
            body = error_body(
                "incomplete_body",
                "The request body ended before its Content-Length; send it again.",
                field="body",
                detail=None,
                request_id=request_id,
            )
            return JsonResponse(body, status=400)
        if isinstance(exception, OSError) and exception.errno in _NO_SPACE:
            # Storage is full: nothing partial was kept (uploads write to temporary files
            # that are removed on failure), and the client may retry later.
            log.error(
                "storage full on %s %s (request %s)", request.method, request.path, request_id
            )
            body = error_body(
                "insufficient_storage",
                "The platform's storage is full; nothing was stored. Retry later.",
                field=None,
                detail=None,
                request_id=request_id,
            )
            response = JsonResponse(body, status=507)
            response["Retry-After"] = "60"
            return response
        if isinstance(exception, RequestDataTooBig):
            limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            body = error_body(
                "too_large",
                f"The request body exceeds the limit of {limit} bytes.",
                field="body",
                detail={"limit": limit},
                request_id=request_id,
            )
            return JsonResponse(body, status=413)
        # The traceback goes to the log under the request id; the client gets the id only,
        # never the exception text (it may hold paths, SQL or data).
        log.error(
            "unhandled %s on %s %s (request %s)",
            type(exception).__name__,
            request.method,
            request.path,
            request_id,
            exc_info=exception,
        )
        body = error_body(
            "server_error",
            "An internal error occurred; quote the request id when reporting it.",
            field=None,
            detail=None,
            request_id=request_id,
        )
        return JsonResponse(body, status=500)


class SecurityHeadersMiddleware:
    """Set ``Content-Security-Policy`` and ``Permissions-Policy`` on every response.

    The pages load scripts, styles and images only from this origin (Swagger UI and ReDoc
    assets are served locally by drf-spectacular-sidecar), and no other site may frame
    them: ``frame-ancestors 'none'`` is the CSP form of ``X-Frame-Options: DENY``, which
    ``XFrameOptionsMiddleware`` still sends for older browsers. A response that already
    carries a policy keeps it.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.policy: str = getattr(settings, "DVBENCH_CONTENT_SECURITY_POLICY", "")
        self.permissions: str = getattr(settings, "DVBENCH_PERMISSIONS_POLICY", "")

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if self.policy and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = self.policy
        if self.permissions and "Permissions-Policy" not in response:
            response["Permissions-Policy"] = self.permissions
        return response


class PrivateCacheMiddleware:
    """``Cache-Control: no-store, private`` on every response to a signed-in user.

    What a signed-in user sees (their organisations' experiments, members, keys, audit
    trail) must not stay in a shared proxy's cache or in the browser's history cache after
    sign-out. A response that already says how it may be cached keeps its own header
    (``never_cache`` on the key page adds ``no-store`` and ``private`` itself); anonymous
    responses (the sign-in page, the public log and trust root) are left alone.
    """

    VALUE = "no-store, private"

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if "Cache-Control" in response:
            return response
        # DRF puts an API key's user on the request; a session's comes from
        # AuthenticationMiddleware.
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            response["Cache-Control"] = self.VALUE
        return response


def _login_paths() -> frozenset[str]:
    paths = {str(settings.LOGIN_URL)}
    with contextlib.suppress(NoReverseMatch):  # the admin is always installed here
        paths.add(reverse("admin:login"))
    return frozenset(paths)


class LoginRateLimitMiddleware:
    """Throttle password guessing on the sign-in pages (web and admin).

    Only failures count (a POST after which the user is still anonymous), per client
    address and per username tried; once either counter is over the limit every sign-in
    attempt from that address or for that username is answered 429 with ``Retry-After``
    until the window passes, without the password being checked.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.paths: frozenset[str] | None = None

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method != "POST":
            return self.get_response(request)
        if self.paths is None:
            self.paths = _login_paths()
        if request.path not in self.paths:
            return self.get_response(request)
        ip = client_ip(request.META)
        username = str(request.POST.get("username", ""))[:150]
        wait = login_wait(ip, username)
        if wait is not None:
            log.warning("sign-in refused: too many failures from %s (retry in %d s)", ip, wait)
            response = HttpResponse(
                f"Too many failed sign-in attempts. Try again in {wait} seconds.\n",
                status=429,
                content_type="text/plain; charset=utf-8",
            )
            response["Retry-After"] = str(wait)
            return response
        response = self.get_response(request)
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            count_login_failure(ip, username)
        return response
