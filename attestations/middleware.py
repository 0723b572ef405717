"""Request ids: one per request, echoed in ``X-Request-ID`` and in every error body."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

REQUEST_ID_HEADER = "X-Request-ID"
# A caller's id is kept only if it is short and plain, so it can be logged and echoed
# without escaping.
_ACCEPTABLE = re.compile(r"^[A-Za-z0-9._:-]{8,64}$")


class RequestIDMiddleware:
    """Attach ``request.request_id`` (the caller's, if acceptable, else a fresh UUID)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = incoming if _ACCEPTABLE.match(incoming) else uuid.uuid4().hex
        request.request_id = request_id  # type: ignore[attr-defined]
        response = self.get_response(request)
        response[REQUEST_ID_HEADER] = request_id
        return response
