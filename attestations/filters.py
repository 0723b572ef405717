"""Query-parameter filters for the list endpoints, documented in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework.filters import BaseFilterBackend
from rest_framework.request import Request

from attestations.exceptions import InvalidRequestError

#: A filter's kind of value: a set of allowed strings, ``int``, or None for any string.
Choices = frozenset[str] | type[int] | None


class QueryFilters(BaseFilterBackend):
    """Exact-match filters declared on the view as ``query_filters``.

    ``query_filters`` maps a query parameter to ``(lookup, choices)``. A value outside
    its choices is a 400 naming the parameter (never an empty page that hides a typo). A
    lookup ending in ``__full_name`` takes an ``owner/name`` experiment id.
    """

    def filter_queryset(
        self, request: Request, queryset: QuerySet[Any], view: Any
    ) -> QuerySet[Any]:
        filters: dict[str, tuple[str, Choices]] = getattr(view, "query_filters", {})
        for param, (lookup, choices) in filters.items():
            value = request.query_params.get(param)
            if value is None or value == "":
                continue
            if choices is int:
                if not value.isdigit():
                    raise InvalidRequestError(
                        f"{param}: expected a whole number, got {value!r}",
                        code="invalid_filter",
                        field=param,
                        detail={"got": value},
                    )
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
                queryset = queryset.filter(**{lookup: value})
        return queryset

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        filters: dict[str, tuple[str, Choices]] = getattr(view, "query_filters", {})
        parameters = []
        for param, (lookup, choices) in filters.items():
            schema: dict[str, Any] = {"type": "string"}
            if choices is int:
                schema = {"type": "integer"}
            elif isinstance(choices, frozenset):
                schema["enum"] = sorted(choices)
            description = (
                "Experiment id, owner/name."
                if lookup.endswith("__full_name")
                else f"Exact match on {param}."
            )
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
