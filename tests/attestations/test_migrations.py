"""Migrating a database of today's schema, with a row in every table, loses nothing.

The server's apps keep the tables they had when all models lived in one app
(``attestations_*``). This test builds the schema the last release shipped
(:data:`RELEASED`) with the migrations it shipped, writes one row to every table of the
platform (each foreign key pointing at another written row), migrates to the newest
migrations, and reads every row back unchanged, through SQL and through the current
models.

The apps' migrations are squashed since (``replaces``): a new database is made by the
squashed ones, while a database made before has recorded the migrations they replace.
The released schema is therefore built by the original migrations (a loader that does
not substitute the squashed ones), and the newest is reached the way a deployed database
reaches it: by the ordinary loader, which goes on from the originals recorded.
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps as current_apps
from django.db import connection, models
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

#: The newest migration of each of the platform's apps before the apps were split, and
#: each split app's last migration before this round's changes of the schema, so that
#: those are undone too (accounts 0002: invitations by username; experiments 0002: a
#: spec's token unit; certificates 0003 and 0004: a certificate's tokens, a log entry's
#: envelope and signed time; uploads 0003: part reservations, 0004: direct uploads).
RELEASED = [
    ("attestations", "0006_organization_kinds_invitations_filings"),
    ("accounts", "0001_initial"),
    ("experiments", "0001_initial"),
    ("certificates", "0002_initial"),
    ("uploads", "0002_gradient_kind"),
]

#: The apps whose models own the platform's tables.
PLATFORM = "attestations"


def _value(field: models.Field[Any, Any], number: int) -> Any:
    """A value the column accepts: its first choice, or one of its type."""
    if field.choices:
        return next(iter(field.flatchoices))[0]
    if isinstance(field, models.UUIDField):
        return uuid.UUID(int=number + 1)
    if isinstance(field, models.BooleanField):
        return True
    if isinstance(field, models.DecimalField):
        return decimal.Decimal("1.5")
    if isinstance(field, models.FloatField):
        return 0.25
    if isinstance(field, models.IntegerField):
        return 7
    if isinstance(field, models.DateTimeField):
        return timezone.now().replace(microsecond=0)
    if isinstance(field, models.DateField):
        return datetime.date(2026, 1, 2)
    if isinstance(field, models.JSONField):
        return {"kept": [1, "two"]}
    if isinstance(field, models.BinaryField):
        return b"\x00kept"
    if isinstance(field, models.GenericIPAddressField):
        return "192.0.2.7"
    if isinstance(field, models.EmailField):
        return f"row{number}@example.org"
    if isinstance(field, models.CharField | models.TextField):
        text = f"r{number}" + "0" * 64
        limit = field.max_length or 200
        return text[:limit]
    raise AssertionError(f"no sample value for {field!r}")


def _ordered(model_list: list[type[models.Model]]) -> Iterator[type[models.Model]]:
    """Models in an order where every required foreign key points at a model before it."""
    done: set[type[models.Model]] = set()
    pending = list(model_list)
    while pending:
        for model in pending:
            needs = {
                field.related_model
                for field in model._meta.concrete_fields
                if field.is_relation and not field.null and field.related_model is not model
            }
            if needs <= done | {m for m in needs if m not in model_list}:
                done.add(model)
                pending.remove(model)
                yield model
                break
        else:
            raise AssertionError(f"foreign keys form a cycle: {pending}")


def _fill(state_apps: Any) -> set[str]:
    """One row in every table of the platform (and a user); returns the tables written."""
    user_model = state_apps.get_model("auth", "User")
    user = user_model.objects.create(username="migrated", password="!")
    rows: dict[type[models.Model], models.Model] = {user_model: user}
    platform = [m for m in state_apps.get_app_config(PLATFORM).get_models() if m._meta.managed]
    late: list[tuple[type[models.Model], str, type[models.Model]]] = []
    for number, model in enumerate(_ordered(platform)):
        values: dict[str, Any] = {}
        for field in model._meta.concrete_fields:
            if isinstance(field, models.AutoField):
                continue
            if field.is_relation:
                target = rows.get(field.related_model)
                if target is None:
                    late.append((model, field.name, field.related_model))
                    continue
                values[field.name] = target
            else:
                values[field.name] = _value(field, number)
        rows[model] = model.objects.create(**values)
    for model, name, target in late:
        # A nullable key to a model written later (Upload.duplicate_of -> Proof).
        model.objects.filter(pk=rows[model].pk).update(**{name: rows[target]})
    return {model._meta.db_table for model in rows}


def _tables() -> list[str]:
    prefix = f"{PLATFORM}_"
    return sorted(t for t in connection.introspection.table_names() if t.startswith(prefix))


#: Columns added since the release, each filled by its migration: ``(table, column)``.
ADDED = {
    ("attestations_invitation", "username"),
    ("attestations_experimentspec", "token_unit"),
    ("attestations_certificate", "tokens"),
    # certificates 0004: a log entry keeps its envelope and its signed time (Rekor dsse).
    ("attestations_logentry", "envelope_json"),
    ("attestations_logentry", "inclusion_promise"),
    ("attestations_logentry", "rfc3161_timestamp"),
    # uploads 0004: S3's multipart upload id of a direct upload (empty for older ones).
    ("attestations_upload", "s3_upload_id"),
    # uploads 0005: a part's digest states and its offset in the data file (NULL for
    # older parts: completion hashes them, and each is a file of its own).
    ("attestations_uploadpart", "chain_base"),
    ("attestations_uploadpart", "chain"),
    ("attestations_uploadpart", "data_offset"),
    # experiments 0003 and certificates 0005: a spec's declared parent run (none for
    # older specs) and a certificate's lineage total (NULL: issued before lineages).
    ("attestations_experimentspec", "parent_transcript"),
    ("attestations_certificate", "lineage_flops"),
    # experiments 0004: the platform kind a spec declares (none for older specs).
    ("attestations_experimentspec", "platform_kind"),
}
#: Tables added since the release: empty after the migration.
NEW_TABLES = {
    "attestations_partreservation",
    "attestations_slicedrun",
    "attestations_slicechallenge",
    "attestations_committedstate",
    "attestations_replayworker",
}


def _snapshot(tables: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, as the database returns it, in a stable order.

    Columns added since the release (:data:`ADDED`) are left out, so that the rows compare.
    """
    snapshot: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for table in tables:
            columns = sorted(
                c.name
                for c in connection.introspection.get_table_description(cursor, table)
                if (table, c.name) not in ADDED
            )
            quoted = ", ".join(connection.ops.quote_name(c) for c in columns)
            cursor.execute(f"SELECT {quoted} FROM {connection.ops.quote_name(table)}")
            snapshot[table] = sorted((tuple(map(str, row)) for row in cursor.fetchall()), key=str)
    return snapshot


def _released_executor() -> MigrationExecutor:
    """An executor that sees the migrations as released: squashed ones do not replace them."""
    executor = MigrationExecutor(connection)
    executor.loader = MigrationLoader(connection, replace_migrations=False)
    return executor


def _migrate_to_newest() -> None:
    """Whatever the test left, the newest schema again, for the tests after it."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_migrating_from_the_released_schema_keeps_every_row() -> None:
    # Nothing of the platform's schema: the squashed migrations made this database.
    MigrationExecutor(connection).migrate([(PLATFORM, None)])
    try:
        released = _released_executor()
        released.migrate(RELEASED)
        released.loader.build_graph()
        written = _fill(released.loader.project_state(RELEASED).apps)
        tables = _tables()
        assert set(tables) == written - {"auth_user"}  # a row in every table
        before = _snapshot(tables)
        assert all(len(rows) == 1 for rows in before.values()), before

        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

        assert set(_tables()) == set(tables) | NEW_TABLES
        assert _snapshot(tables) == before
        # An invitation's username is its user's (accounts 0002).
        with connection.cursor() as cursor:
            cursor.execute("SELECT username FROM attestations_invitation")
            assert cursor.fetchall() == [("migrated",)]
            # A spec declared before the unit existed counts examples (experiments 0002).
            cursor.execute("SELECT token_unit FROM attestations_experimentspec")
            assert cursor.fetchall() == [("examples",)]
            cursor.execute("SELECT chain_base, chain, data_offset FROM attestations_uploadpart")
            assert cursor.fetchall() == [(None, None, None)]
            cursor.execute("SELECT parent_transcript FROM attestations_experimentspec")
            assert cursor.fetchall() == [("",)]
            cursor.execute("SELECT lineage_flops FROM attestations_certificate")
            assert cursor.fetchall() == [(None,)]
            cursor.execute("SELECT platform_kind FROM attestations_experimentspec")
            assert cursor.fetchall() == [("",)]
        # And the current models read each row.
        for model in current_apps.get_models():
            if model._meta.db_table in before:
                assert model._base_manager.count() == 1, model
                assert model._base_manager.get() is not None
    finally:
        _migrate_to_newest()


def _original_leaves(loader: MigrationLoader) -> list[tuple[str, str]]:
    """Each app's newest migration, counting only the originals a squash replaces."""
    squashed = {key for key, migration in loader.disk_migrations.items() if migration.replaces}
    newest: dict[str, str] = {}
    for app, name in loader.disk_migrations:
        if (app, name) not in squashed and name > newest.get(app, ""):
            newest[app] = name
    return sorted(newest.items())


def _schema() -> dict[str, list[tuple[Any, ...]]]:
    """The public schema as PostgreSQL states it: columns, constraints, indexes, triggers
    and the functions the triggers run."""
    queries = {
        "columns": "SELECT table_name, ordinal_position, column_name, data_type, is_nullable,"
        " column_default, character_maximum_length FROM information_schema.columns"
        " WHERE table_schema = 'public' ORDER BY 1, 2",
        "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)"
        " FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
        "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes"
        " WHERE schemaname = 'public' ORDER BY 1, 2",
        "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)"
        " FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1, 2",
        "functions": "SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
        " WHERE pronamespace = 'public'::regnamespace ORDER BY 1",
    }
    with connection.cursor() as cursor:
        schema = {}
        for what, sql in queries.items():
            cursor.execute(sql)
            schema[what] = cursor.fetchall()
    return schema


@pytest.mark.django_db(transaction=True)
def test_the_squashed_migrations_make_the_schema_the_originals_make() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("compared on PostgreSQL, the only database with the append-only triggers")
    try:
        MigrationExecutor(connection).migrate([(PLATFORM, None)])
        _migrate_to_newest()  # nothing of the platform applied: the squashed migrations
        squashed = _schema()
        assert squashed["triggers"] and squashed["functions"]

        MigrationExecutor(connection).migrate([(PLATFORM, None)])
        originals = _released_executor()
        originals.migrate(_original_leaves(originals.loader))

        assert _schema() == squashed
    finally:
        _migrate_to_newest()
