"""Database building blocks every app shares: append-only rows, and claims on work.

* :class:`AppendOnlyModel` and :class:`AppendOnlyQuerySet`: rows that are inserted once
  and never changed or deleted through the ORM (the audit trail, the transparency log,
  trust roots, certificates). On PostgreSQL a trigger refuses the same in SQL
  (migrations ``certificates.0003_append_only`` and ``audit.0002_append_only``).
* :func:`take_claim`: how a worker takes a row to work on (a proof to verify, a
  challenge to replay): one conditional UPDATE, so of two deliveries of the same task
  one wins, and a claim older than the task time limit (its worker died) can be taken
  over.
* :func:`prepared_cursor`: a cursor for the few hot read statements, which PostgreSQL
  plans once per connection instead of on every request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar, cast

from django.conf import settings
from django.db import connections, models
from django.db.models import Q
from django.utils import timezone

__all__ = [
    "AppendOnlyError",
    "AppendOnlyModel",
    "AppendOnlyQuerySet",
    "prepared_cursor",
    "take_claim",
    "task_time_limit",
]

_M = TypeVar("_M", bound=models.Model)


class AppendOnlyError(Exception):
    """Raised on an attempt to change or delete an append-only row."""


class AppendOnlyQuerySet(models.QuerySet[_M]):
    """A queryset whose rows may be inserted and read, never changed in bulk."""

    def update(self, **kwargs: Any) -> int:
        raise AppendOnlyError(f"{self.model.__name__} rows are append-only; they cannot be updated")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError(f"{self.model.__name__} rows are append-only; they cannot be deleted")


class AppendOnlyModel(models.Model):
    """Rows are inserted once; ``save`` of an existing row and ``delete`` raise.

    Subclasses set ``objects = AppendOnlyQuerySet.as_manager()`` so that bulk updates
    and deletes raise too.
    """

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnlyError(
                f"{type(self).__name__} rows are append-only; they cannot be updated"
            )
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError(f"{type(self).__name__} rows are append-only; they cannot be deleted")


def task_time_limit() -> timedelta:
    """The hard time limit of a task: a claim older than this belonged to a dead worker."""
    return timedelta(seconds=int(getattr(settings, "CELERY_TASK_TIME_LIMIT", 3600)))


def take_claim(rows: models.QuerySet[Any], *, waiting: str, working: str, **also: Any) -> bool:
    """Move one row from ``waiting`` to ``working`` for this worker; False if another has it.

    A row already ``working`` whose ``claimed`` time is older than the task time limit
    (:func:`task_time_limit`) belonged to a worker that died, and is taken over. The rows
    need a ``status`` and a ``claimed`` field; ``also`` are further fields to set in the
    same UPDATE (an attempt counter, say).
    """
    now = timezone.now()
    stale = now - task_time_limit()
    taken = rows.filter(Q(status=waiting) | Q(status=working, claimed__lt=stale)).update(
        status=working, claimed=now, **also
    )
    return bool(taken)


@contextmanager
def prepared_cursor(using: str = "default") -> Iterator[Any]:
    """A cursor whose statements PostgreSQL may prepare: parse and plan once per connection.

    For hand-written SQL run on every request (the API key lookup, the experiment list),
    whose planning costs about as much as running it. Django binds parameters on the
    client, which cannot prepare; on PostgreSQL this cursor binds on the server (psycopg
    turns ``%s`` into ``$1``), so psycopg prepares a statement once it has run
    ``prepare_threshold`` times in the connection (``DATABASE_URL``'s option, 5 unless
    set; ``none`` turns it off). psycopg keeps at most ``prepared_max`` statements per
    connection and forgets them on a rollback or a schema change. The cursor is wrapped
    as Django wraps its own, so ``execute_wrapper`` hooks and query logging see it.
    Elsewhere (SQLite) it is Django's plain cursor.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            yield cursor
        return
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.ensure_connection()
    # What connection.cursor() does, with psycopg's server-binding cursor class.
    raw: Any = ServerBindingCursor(connection.connection)  # type: ignore[call-arg]
    with cast(Any, connection)._prepare_cursor(raw) as cursor:
        yield cursor
