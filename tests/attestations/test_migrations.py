"""Each app has one migration history, and it makes the schema the models describe.

Nothing was released before these histories, so they start at each app's
``0001_initial``: no squashed migration, no ``replaces``, and no app above the domain
apps (``attestations`` is a package, not an app). The tests here guarantee that

- every change of a model has its migration (``makemigrations --check``);
- an empty database migrates forward to the newest, back to zero and forward again, to
  the same schema, on SQLite and on PostgreSQL;
- on PostgreSQL the hand-written migrations are in effect: the append-only triggers of
  the audit trail (``audit.0002_append_only``) and of the transparency log, its
  checkpoints, the certificates and the trust roots (``certificates.0003_append_only``).
  What the triggers refuse and allow is tested with the tables' rows, in
  ``tests/attestations/audit/test_audit.py`` and
  ``tests/attestations/certificates/test_certificates.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from attestations.certificates.models import TrustRootVersion

#: The apps whose models own the platform's tables (the domain apps with models).
PLATFORM = (
    "accounts",
    "audit",
    "experiments",
    "uploads",
    "proofs",
    "challenges",
    "certificates",
    "workers",
)

#: Each append-only table and the PL/pgSQL function its trigger runs.
APPEND_ONLY = {
    "attestations_auditevent": "dvbench_audit_append_only",
    "attestations_logentry": "dvbench_append_only",
    "attestations_logcheckpoint": "dvbench_append_only",
    "attestations_certificate": "dvbench_append_only",
    "attestations_trustrootversion": "dvbench_append_only",
}


def _platform_tables() -> set[str]:
    """The tables the platform's models name (``Meta.db_table``)."""
    return {
        model._meta.db_table
        for label in PLATFORM
        for model in apps.get_app_config(label).get_models()
    }


def _migrate(targets: list[tuple[str, str | None]] | None = None) -> None:
    """Migrate to ``targets``, or to the newest of every app when None."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets or executor.loader.graph.leaf_nodes())


def _schema() -> dict[str, list[tuple[Any, ...]]]:
    """The schema as the database states it: on PostgreSQL its columns, constraints,
    indexes, triggers and the functions the triggers run; on SQLite its ``sqlite_master``."""
    if connection.vendor == "postgresql":
        queries = {
            "columns": "SELECT table_name, column_name, data_type, is_nullable,"
            " column_default, character_maximum_length FROM information_schema.columns"
            " WHERE table_schema = 'public' ORDER BY 1, 2",
            "constraints": "SELECT conrelid::regclass::text, conname,"
            " pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
            "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes"
            " WHERE schemaname = 'public' ORDER BY 1, 2",
            "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)"
            " FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1, 2",
            "functions": "SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
            " WHERE pronamespace = 'public'::regnamespace ORDER BY 1",
        }
    else:
        queries = {
            "objects": "SELECT type, name, tbl_name, sql FROM sqlite_master"
            " WHERE name NOT LIKE 'sqlite_%' ORDER BY 1, 2",
        }
    with connection.cursor() as cursor:
        schema = {}
        for what, sql in queries.items():
            cursor.execute(sql)
            schema[what] = cursor.fetchall()
    return schema


def _triggers() -> dict[str, str]:
    """Each table's ``*_append_only`` trigger, as PostgreSQL states it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE NOT tgisinternal AND tgname LIKE %s AND tgenabled = 'O'",
            ["%_append_only"],
        )
        return dict(cursor.fetchall())


def test_every_app_has_one_history_and_there_is_no_root_app() -> None:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    histories = {app for app, _ in loader.disk_migrations if app in PLATFORM}
    assert histories == set(PLATFORM)
    assert not apps.is_installed("attestations")
    assert "attestations" not in loader.migrated_apps
    assert not [key for key, migration in loader.disk_migrations.items() if migration.replaces]
    for app in PLATFORM:
        roots = loader.graph.root_nodes(app)
        assert [name for _, name in roots] == ["0001_initial"], app


@pytest.mark.django_db
def test_every_model_change_has_a_migration() -> None:
    # makemigrations exits (SystemExit 1) when a model differs from its migrations; it
    # also checks the test database's applied migrations against the histories.
    call_command("makemigrations", check=True, dry_run=True, verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_an_empty_database_migrates_forward_back_to_zero_and_forward_again() -> None:
    tables = _platform_tables()
    try:
        _migrate([(app, None) for app in PLATFORM])
        assert not tables & set(connection.introspection.table_names())
        if connection.vendor == "postgresql":
            assert _triggers() == {}  # and the reverse dropped the trigger functions:
            assert not _schema()["functions"]

        _migrate()
        assert tables <= set(connection.introspection.table_names())
        forward = _schema()

        _migrate([(app, None) for app in PLATFORM])
        assert not tables & set(connection.introspection.table_names())
        _migrate()
        assert _schema() == forward
    finally:
        _migrate()


@pytest.mark.django_db(transaction=True)
def test_the_append_only_triggers_are_in_effect_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the append-only triggers exist on PostgreSQL only")
    assert _triggers() == {
        table: f"CREATE TRIGGER {table}_append_only BEFORE DELETE OR UPDATE ON public.{table}"
        f" FOR EACH ROW EXECUTE FUNCTION {function}()"
        for table, function in APPEND_ONLY.items()
    }
    # The trust roots' SQL guard, which the certificate tests do not exercise with a row.
    version = TrustRootVersion.objects.create(version=1, document="{}", digest="00" * 32)
    for statement in (
        "UPDATE attestations_trustrootversion SET document = '[]' WHERE id = %s",
        "DELETE FROM attestations_trustrootversion WHERE id = %s",
    ):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(statement, [version.pk])
    assert TrustRootVersion.objects.get(pk=version.pk).document == "{}"
