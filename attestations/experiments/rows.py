"""The experiment list's page of rows, read by SQL compiled once per query shape.

Every API request for ``/api/v1/experiments/`` asks the same few questions: which
experiments of the caller's organisations (maybe filtered), newest first, 50 at a time.
Building that query through the ORM cost more than running it (about 2 ms of query
construction and compilation per request against well under 1 ms in PostgreSQL, measured
on the 2-core CI machine; docs/reliability.md, Load). :class:`SummaryPage` stands in for
the queryset that DRF's filters and cursor paginator work on: it records ``filter`` and
``order_by`` calls, and on slicing runs SQL the ORM compiled for the same *shape* (the
lookups, the number of ids in an ``IN``, the order, offset and limit), with this
request's values as parameters. A shape's SQL is cached only after checking that the
parameters it would be given are exactly those the ORM produced for it, so a value the
ORM would transform differently is never bound wrongly: such a shape is compiled on every
request, as before. Proof counts and the frozen flag come in the same query: each row
carries its proofs grouped by status and spec as a JSON array, from a correlated subquery
that PostgreSQL evaluates only for the rows of the page, after the sort and the limit
(SQLite, the demo's database, runs the same subquery; the settings allow no other).
Rows are the dictionaries
:func:`~attestations.experiments.models.summary_dict` turns into the API representation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections, models
from django.db.models.expressions import RawSQL

from attestations.accounts.models import Access, Capability
from attestations.core.db import prepared_cursor
from attestations.experiments.models import (
    SUMMARY_COLUMNS,
    Experiment,
    certificate_results,
    proof_statuses,
)

#: Lookups whose value is a list: one parameter per item, and ``[]`` matches nothing.
_LIST_LOOKUPS = frozenset({"in"})
_COMPARISONS = frozenset({"exact", "in", "lt", "lte", "gt", "gte"})

Converter = tuple[list[Callable[..., Any]], Any]
Lookup = tuple[str, Any]


class _Compiled:
    """One shape's SQL: the statement, its column names and the ORM's value converters."""

    __slots__ = ("converters", "names", "sql")

    def __init__(self, sql: str, names: list[str], converters: dict[int, Converter]) -> None:
        self.sql, self.names, self.converters = sql, names, converters


#: Compiled SQL by (database alias, shape). Bounded: a shape is made of the view's few
#: filters, an IN of at most the caller's organisations, two orders, and an offset and
#: a page size that the paginator bounds (offset_cutoff, max_page_size).
_CACHE: dict[tuple[Any, ...], _Compiled] = {}
_CACHE_LIMIT = 4096


class SummaryPage:
    """A lazy, queryset-like source of the experiment list's rows (see the module doc).

    Supports what :class:`~attestations.http.filters.QueryFilters` and DRF's
    ``CursorPagination`` call: ``filter(**lookups)``, ``order_by(*fields)`` and slicing
    with a step-less slice, which runs the query.
    """

    model = Experiment

    def __init__(
        self, lookups: Sequence[Lookup] = (), ordering: Sequence[str] = (), using: str = "default"
    ) -> None:
        self.lookups = tuple(lookups)
        self.ordering = tuple(ordering)
        self.db = using

    @classmethod
    def visible_to(cls, access: Access) -> SummaryPage:
        """Experiments whose owner ``access`` may read (as ``ExperimentQuerySet.visible_to``)."""
        ids = access.org_ids(Capability.READ)
        return cls(() if ids is None else (("owner_id__in", ids),))

    def filter(self, **lookups: Any) -> SummaryPage:
        return SummaryPage((*self.lookups, *lookups.items()), self.ordering, self.db)

    def order_by(self, *fields: str) -> SummaryPage:
        return SummaryPage(self.lookups, fields, self.db)

    def __getitem__(self, bounds: slice) -> list[dict[str, Any]]:
        if not isinstance(bounds, slice) or bounds.step is not None:
            raise TypeError("SummaryPage supports only a slice without a step")
        offset = bounds.start or 0
        limit = None if bounds.stop is None else bounds.stop - offset
        if limit is not None and limit <= 0:
            return []
        if any(_is_list(name) and not list(value) for name, value in self.lookups):
            return []  # as the ORM: an empty IN matches nothing, and no query runs
        rows = self._rows(offset, limit)
        self._summarize(rows)
        return rows

    # --- The page query ---------------------------------------------------------------

    def _queryset(self, offset: int, limit: int | None) -> models.QuerySet[Any, Any]:
        """The ORM's version of this page: what the cached SQL was compiled from."""
        rows = Experiment.objects.using(self.db).values(*SUMMARY_COLUMNS)
        for name, value in self.lookups:
            rows = rows.filter(**{name: value})
        rows = rows.order_by(*self.ordering)
        rows = rows.annotate(**{_GROUPS: RawSQL(_groups_sql(self.db), ())})  # noqa: S611 (no values)
        page: models.QuerySet[Any, Any] = (
            rows[offset:] if limit is None else rows[offset : offset + limit]
        )
        return page

    def _rows(self, offset: int, limit: int | None) -> list[dict[str, Any]]:
        connection = connections[self.db]
        shape = (
            self.db,
            tuple((name, len(value) if _is_list(name) else None) for name, value in self.lookups),
            self.ordering,
            offset,
            limit,
        )
        compiled = _CACHE.get(shape)
        params: list[Any] | None = None
        if compiled is not None:
            params = self._params(connection)
        else:
            query = self._queryset(offset, limit).query
            compiler = query.get_compiler(using=self.db)
            sql, orm_params = compiler.as_sql()
            select = [column for column, _, _ in compiler.select]
            names = [*query.extra_select, *query.values_select, *query.annotation_select]
            compiled = _Compiled(sql, names, compiler.get_converters(select))
            params = list(orm_params)
            if _same(self._params(connection), params) and len(_CACHE) < _CACHE_LIMIT:
                _CACHE[shape] = compiled
        with prepared_cursor(self.db) as cursor:
            cursor.execute(compiled.sql, params)
            fetched = cursor.fetchall()
        names, converters = compiled.names, compiled.converters
        rows = []
        for row in fetched:
            values = list(row)
            for index, (functions, expression) in converters.items():
                for function in functions:
                    values[index] = function(values[index], expression, connection)
            rows.append(dict(zip(names, values, strict=True)))
        return rows

    def _params(self, connection: Any) -> list[Any]:
        """The parameters this page's lookups bind, prepared as the ORM prepares them."""
        params: list[Any] = []
        for name, value in self.lookups:
            field = _field(name)
            values = list(value) if _is_list(name) else [value]
            params.extend(
                field.get_db_prep_value(field.get_prep_value(item), connection, prepared=True)
                for item in values
            )
        return params

    # --- Proof counts and the frozen flag -----------------------------------------------

    def _summarize(self, rows: list[dict[str, Any]]) -> None:
        """Turn each row's ``[[status, spec, result, count]]`` into ``proofs_<status>``,
        ``certificates_<result>`` and ``spec_frozen`` (as :meth:`Experiment.summarize`)."""
        zeros = dict.fromkeys([f"proofs_{status}" for status in proof_statuses()], 0)
        zeros.update(dict.fromkeys([f"certificates_{r}" for r in certificate_results()], 0))
        zeros["spec_frozen"] = False
        for row in rows:
            groups = row.pop(_GROUPS, None) or []
            row.update(zeros)
            # psycopg parses a json value; SQLite returns its text.
            for status, spec_id, result, count in (
                json.loads(groups) if isinstance(groups, str) else groups
            ):
                row[f"proofs_{status}"] = row.get(f"proofs_{status}", 0) + count
                if result is not None:
                    row[f"certificates_{result}"] = row.get(f"certificates_{result}", 0) + count
                # A spec is frozen when a proof of the experiment names it.
                if spec_id == row["current_spec_id"]:
                    row["spec_frozen"] = True


def _is_list(lookup: str) -> bool:
    return lookup.rpartition("__")[2] in _LIST_LOOKUPS


def _field(lookup: str) -> Any:
    """The model field a lookup such as ``current_spec__max_flops__gte`` compares."""
    parts = lookup.split("__")
    if len(parts) > 1 and parts[-1] in _COMPARISONS:
        parts = parts[:-1]
    model: Any = Experiment
    field: Any = None
    for part in parts:
        field = model._meta.get_field(part)
        model = field.related_model
    if field.is_relation and field.many_to_one:
        field = field.target_field
    return field


def _same(ours: list[Any], orm: list[Any]) -> bool:
    return len(ours) == len(orm) and all(
        type(a) is type(b) and a == b for a, b in zip(ours, orm, strict=True)
    )


#: The row key of the page query's grouped proofs (not a field name of Experiment).
_GROUPS = "proof_groups"

#: JSON aggregation by database vendor: (array of rows, one row as an array).
_GROUPS_SQL = {
    "postgresql": ("json_agg", "json_build_array"),
    "sqlite": ("json_group_array", "json_array"),
}


def _groups_sql(using: str) -> str:
    """One experiment's proofs grouped by status, spec and certificate result, as
    ``[[status, spec, result, count]]`` (result null for a proof without a certificate).

    A correlated subquery over the outer query's experiment table; NULL when it has none.
    A proof has at most one certificate (a one-to-one), so the join multiplies no row.
    """
    connection = connections[using]
    quote = connection.ops.quote_name
    aggregate, array = _GROUPS_SQL[connection.vendor]
    proof = Experiment._meta.get_field("proofs").related_model
    meta = proof._meta

    def column(name: str) -> str:
        field = meta.get_field(name)
        assert isinstance(field, models.Field)
        return quote(str(field.column))

    outer = f"{quote(Experiment._meta.db_table)}.{quote(str(Experiment._meta.pk.column))}"
    experiment, status, spec = column("experiment"), column("status"), column("spec")
    certified_model = meta.get_field("certificate").related_model
    assert certified_model is not None
    certificate = certified_model._meta
    table = quote(meta.db_table)
    pk = f"{table}.{quote(str(meta.pk.column))}"
    proof_column = certificate.get_field("proof")
    result_column = certificate.get_field("result")
    assert isinstance(proof_column, models.Field) and isinstance(result_column, models.Field)
    certified = quote(certificate.db_table)
    result = f"{certified}.{quote(str(result_column.column))}"
    # Only names from the models' metadata, quoted; there are no values in it.
    return (
        f"SELECT {aggregate}({array}(g.s, g.p, g.r, g.n)) FROM ("  # noqa: S608
        f"SELECT {table}.{status} AS s, {table}.{spec} AS p, {result} AS r, COUNT(*) AS n "
        f"FROM {table} LEFT JOIN {certified} "
        f"ON {certified}.{quote(str(proof_column.column))} = {pk} "
        f"WHERE {table}.{experiment} = {outer} GROUP BY {table}.{status}, {table}.{spec}, "
        f"{result}) AS g"
    )
