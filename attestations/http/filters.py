"""Query-parameter filters for the list endpoints, documented in the OpenAPI schema."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from rest_framework.filters import BaseFilterBackend
from rest_framework.request import Request
from rest_framework.settings import api_settings

from attestations.core.errors import InvalidRequestError


class BigInt(int):
    """Marks a filter on a 40-digit decimal column (FLOPs): whole numbers up to 10**40 - 1."""


#: A filter's kind of value: a set of allowed strings, ``int`` (a 64-bit id or count),
#: ``BigInt``, ``datetime`` (an ISO 8601 date or date-time), or None for any string.
Choices = frozenset[str] | type[int] | type[BigInt] | type[datetime] | None

#: The range of each kind of whole-number filter: what the column can hold.
INT_RANGES: dict[type[int], tuple[int, int]] = {int: (0, 2**63 - 1), BigInt: (0, 10**40 - 1)}


class QueryFilters(BaseFilterBackend):
    """Filters declared on the view as ``query_filters``.

    ``query_filters`` maps a query parameter to ``(lookup, choices)``; the lookup may end
    in a comparison (``__gte``, ``__lt``). A value that does not fit is a 400 naming the
    parameter (never an empty page that hides a typo). A lookup ending in
    ``__full_name`` takes an ``owner/name`` experiment id. ``query_filter_help`` on the
    view describes parameters in the schema.

    A query parameter that is none of these, nor the paginator's (``cursor``,
    ``page_size``), nor DRF's ``format``, nor one the view reads itself (its
    ``query_params_also``), is a 400 ``unknown_filter`` naming the allowed ones: a
    misspelt or unsupported filter would otherwise return every row, as if it matched.
    """

    def filter_queryset(
        self, request: Request, queryset: QuerySet[Any], view: Any
    ) -> QuerySet[Any]:
        filters: dict[str, tuple[str, Choices]] = getattr(view, "query_filters", {})
        check_known_parameters(request, view)
        for param, (lookup, choices) in filters.items():
            value = request.query_params.get(param)
            if value is None or (value == "" and choices is None):
                # An empty free-text filter filters nothing; an empty number, date or
                # choice is not one (400 below), as the schema says.
                continue
            parsed: Any = value
            if "\x00" in value:
                # PostgreSQL text cannot hold NUL; the query would fail, not match nothing.
                raise _invalid(param, "must not contain a NUL character", value)
            if choices in INT_RANGES:
                low, high = INT_RANGES[choices]
                # Checked before the database sees it: SQLite cannot even bind an integer
                # past 2**63 (OverflowError), PostgreSQL refuses it.
                if not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
                    raise _invalid(
                        param, f"expected a whole number from {low} to {high}, got {value!r}", value
                    )
                parsed = int(value)
            elif choices is datetime:
                parsed = _moment(param, value)
            elif isinstance(choices, frozenset) and value not in choices:
                raise InvalidRequestError(
                    f"{param}: {value!r} is not one of {', '.join(sorted(choices))}",
                    code="invalid_filter",
                    field=param,
                    detail={"allowed": sorted(choices), "got": value},
                )
            if lookup.endswith("__full_name"):
                owner, _, name = value.partition("/")
                prefix = lookup.removesuffix("full_name")
                queryset = queryset.filter(**{f"{prefix}owner__slug": owner, f"{prefix}name": name})
            else:
                queryset = queryset.filter(**{lookup: parsed})
        return queryset

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        filters: dict[str, tuple[str, Choices]] = getattr(view, "query_filters", {})
        help_texts: dict[str, str] = getattr(view, "query_filter_help", {})
        parameters = []
        for param, (lookup, choices) in filters.items():
            schema: dict[str, Any] = {"type": "string"}
            if choices in INT_RANGES:
                low, high = INT_RANGES[choices]
                schema = {"type": "integer", "minimum": low, "maximum": high}
            elif choices is datetime:
                schema["format"] = "date-time"
            elif isinstance(choices, frozenset):
                schema["enum"] = sorted(choices)
            if param in help_texts:
                description = help_texts[param]
            elif lookup.endswith("__full_name"):
                description = "Experiment id, owner/name."
            else:
                description = f"Exact match on {param}."
            parameters.append(
                {
                    "name": param,
                    "required": False,
                    "in": "query",
                    "description": description,
                    "schema": schema,
                }
            )
        return parameters


def allowed_parameters(view: Any) -> list[str]:
    """Every query parameter ``view`` reads: its filters, its own, pagination, ``format``."""
    allowed = set(getattr(view, "query_filters", {})) | set(getattr(view, "query_params_also", ()))
    paginator = getattr(view, "paginator", None)
    for attribute in ("cursor_query_param", "page_size_query_param", "page_query_param"):
        name = getattr(paginator, attribute, None) if paginator is not None else None
        if name:
            allowed.add(str(name))
    if api_settings.URL_FORMAT_OVERRIDE:
        allowed.add(str(api_settings.URL_FORMAT_OVERRIDE))
    return sorted(allowed)


def check_known_parameters(request: Request, view: Any) -> None:
    """400 ``unknown_filter`` for a query parameter ``view`` does not read (the first, sorted)."""
    allowed = allowed_parameters(view)
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        name = unknown[0]
        shown = name if len(name) <= 100 else f"{name[:100]}..."
        raise InvalidRequestError(
            f"{shown!r} is not a query parameter of this endpoint; allowed: {', '.join(allowed)}",
            code="unknown_filter",
            field=shown,
            detail={"allowed": allowed, "got": shown},
        )


def _invalid(param: str, message: str, value: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: {message}", code="invalid_filter", field=param, detail={"got": value}
    )


def _moment(param: str, value: str) -> datetime:
    """An ISO 8601 date (midnight UTC) or date-time (UTC when it has no offset)."""
    try:
        moment = parse_datetime(value)
        if moment is None and (day := parse_date(value)) is not None:
            moment = datetime(day.year, day.month, day.day)
    except ValueError:
        moment = None
    if moment is None:
        raise _invalid(param, f"expected an ISO 8601 date or date-time, got {value!r}", value)
    if not timezone.is_aware(moment):
        return moment.replace(tzinfo=UTC)
    try:
        # In UTC: PostgreSQL refuses offsets Python accepts (up to 24 h), e.g. -20:11.
        return moment.astimezone(UTC)
    except OverflowError:
        raise _invalid(param, f"{value!r} is out of the representable range", value) from None
