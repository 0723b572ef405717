"""Cursor pagination for every list endpoint: stable under inserts, no page counting.

A cursor is opaque to clients but not to an attacker: DRF decodes it and hands its
position to the database as a value of the ordering field. Here a cursor that is not one
this API could have issued (not base64, a position that is no date-time or no integer of
the column's range) is a 404 ``invalid_cursor`` (the page it names does not exist; DRF's
own answer to an undecodable cursor) before any query runs, and ``page_size`` outside
1..``max_page_size`` is a 400 rather than silently replaced.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import NotFound
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request

from attestations.core.errors import InvalidRequestError, NotFoundError

#: The largest value of a 64-bit integer column.
INT64_MAX = 2**63 - 1


def _invalid_cursor(message: str) -> NotFoundError:
    return NotFoundError(
        f"cursor: {message}; use the next or previous link of a page as it is",
        code="invalid_cursor",
        field="cursor",
    )


class CursorPage(CursorPagination):
    """Newest first, 50 a page; ``?page_size=`` up to 200; ``next``/``previous`` cursors."""

    page_size = 50
    max_page_size = 200
    page_size_query_param = "page_size"
    # The id breaks ties: rows created in the same instant must come back in one order
    # on every page, or a cursor skips or repeats them (PostgreSQL's top-N sort is not
    # stable).
    ordering: Any = ("-created", "-id")

    def get_page_size(self, request: Request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return int(self.page_size)
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= self.max_page_size:
            raise InvalidRequestError(
                f"page_size: expected a whole number from 1 to {self.max_page_size}, got {raw!r}",
                code="invalid_filter",
                field="page_size",
                detail={"minimum": 1, "maximum": self.max_page_size, "got": raw},
            )
        return int(raw)

    def decode_cursor(self, request: Request) -> Cursor | None:
        raw = request.query_params.get(self.cursor_query_param)
        if raw is not None and not raw.isascii():
            raise _invalid_cursor("not a cursor this API issued")
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise _invalid_cursor("not a cursor this API issued") from None
        except UnicodeDecodeError:
            raise _invalid_cursor("not a cursor this API issued") from None
        if cursor is None or cursor.position is None:
            return cursor
        self._check_position(request, str(cursor.position))
        return cursor

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        self._model = getattr(queryset, "model", None)
        return super().paginate_queryset(queryset, request, view)

    def _check_position(self, request: Request, position: str) -> None:
        """The position must be a value of the first ordering field's type and range."""
        model = getattr(self, "_model", None)
        name = str(self.ordering[0]).lstrip("-")
        field = model._meta.get_field(name) if model is not None else None
        if isinstance(field, models.DateTimeField):
            try:
                moment = parse_datetime(position)
            except ValueError:
                moment = None
            # The cursors this API issues carry an offset (+00:00); a naive one is forged.
            valid = moment is not None and moment.tzinfo is not None
            if not valid:
                raise _invalid_cursor(f"its position {position!r:.40} is not a date-time")
        elif isinstance(field, models.IntegerField | models.AutoField) and (
            not (position.isascii() and position.isdigit()) or int(position) > INT64_MAX
        ):
            raise _invalid_cursor(f"its position {position!r:.40} is not a whole number")

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"] = {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": self.max_page_size,
                }
                parameter["description"] = f"Results per page, 1 to {self.max_page_size}."
            elif parameter["name"] == self.cursor_query_param:
                parameter["description"] = (
                    "The next or previous link's cursor, as it is (404 invalid_cursor if "
                    "it is not one this API issued)."
                )
        return parameters
