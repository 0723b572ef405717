"""Cursor pagination for every list endpoint: stable under inserts, no page counting."""

from __future__ import annotations

from rest_framework.pagination import CursorPagination


class CursorPage(CursorPagination):
    """Newest first, 50 a page; ``?page_size=`` up to 200; ``next``/``previous`` cursors."""

    page_size = 50
    max_page_size = 200
    page_size_query_param = "page_size"
    # The id breaks ties: rows created in the same instant must come back in one order
    # on every page, or a cursor skips or repeats them (PostgreSQL's top-N sort is not
    # stable).
    ordering = ("-created", "-id")
