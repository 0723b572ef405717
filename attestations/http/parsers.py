"""The API's JSON parser: DRF's, with a bound on nesting and no short bodies.

No request of this API nests JSON more than a few levels (``{"files": [{...}]}``), but
``json.loads`` follows a body of 100,000 ``[`` until Python's recursion limit raises
``RecursionError``, which DRF does not expect (a 500), and anything that walks a deep
value recursively afterwards (validation, error details) would do the same. Here a body
deeper than :data:`MAX_DEPTH` is a 400 ``too_deep`` before any view sees it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from django.http import UnreadablePostError
from rest_framework import parsers

if TYPE_CHECKING:
    from attestations.http.exceptions import TooDeepError

#: The deepest nesting of arrays and objects a request body may have.
MAX_DEPTH = 32


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply arrays and objects nest in ``value`` (0 for a scalar), without recursing.

    Stops counting at ``limit + 1``: the caller only needs to know it is too deep.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def too_deep() -> TooDeepError:
    # Imported here: DRF loads this parser while attestations.http.exceptions imports DRF.
    from attestations.http.exceptions import TooDeepError

    return TooDeepError(
        f"The JSON body nests arrays or objects more than {MAX_DEPTH} levels deep; no "
        "request of this API needs more than a few.",
        field="body",
        detail={"max_depth": MAX_DEPTH},
    )


def whole_body(stream: IO[Any], parser_context: Mapping[str, Any] | None) -> IO[bytes]:
    """The body, read whole; one that ended before its ``Content-Length`` is refused.

    A server reads a body up to its Content-Length and sees the end early when the client
    closes its side; what came is a prefix, which may even parse (a whole JSON object,
    without the padding that was never sent). ``UnreadablePostError`` is what Django
    raises for a body it could not read, and the API answers it 400 ``incomplete_body``
    (``attestations/http/middleware.py``).
    """
    request = (parser_context or {}).get("request")
    try:
        expected = int(request.META.get("CONTENT_LENGTH") or 0) if request is not None else 0
    except ValueError:
        expected = 0
    body = stream.read()
    if len(body) < expected:
        raise UnreadablePostError(f"the body ended after {len(body)} of {expected} bytes")
    return io.BytesIO(body)


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser; a body nested deeper than :data:`MAX_DEPTH` is a 400 ``too_deep``."""

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            data = super().parse(whole_body(stream, parser_context), media_type, parser_context)
        except RecursionError:
            raise too_deep() from None
        if nesting_depth(data) > MAX_DEPTH:
            raise too_deep()
        return data
