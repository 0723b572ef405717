"""The transparency log, its checkpoints, the certificates and the published trust roots
are append-only in SQL too, on PostgreSQL.

The models refuse updates and deletes (``AppendOnlyError``); on PostgreSQL these
triggers refuse them in SQL too, so a stray UPDATE from a shell cannot rewrite history
either. (TRUNCATE stays possible: it is how test databases are flushed, and it is not a
thing an application path does.) SQLite has no such guard; ``manage.py verify_log``
detects altered rows on every database.
"""

from django.db import migrations

APPEND_ONLY_TABLES = (
    "attestations_logentry",
    "attestations_logcheckpoint",
    "attestations_certificate",
    "attestations_trustrootversion",
)


def _create_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        """
        CREATE OR REPLACE FUNCTION dvbench_append_only() RETURNS trigger AS $$
        BEGIN
            RAISE EXCEPTION 'table % is append-only: % is not allowed', TG_TABLE_NAME, TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END;
        $$ LANGUAGE plpgsql
        """,
        params=None,  # no placeholders: the '%' are PL/pgSQL's own
    )
    for table in APPEND_ONLY_TABLES:
        schema_editor.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION dvbench_append_only()"
        )


def _drop_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in APPEND_ONLY_TABLES:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
    schema_editor.execute("DROP FUNCTION IF EXISTS dvbench_append_only()")


class Migration(migrations.Migration):
    dependencies = [
        ("certificates", "0002_initial"),
    ]

    operations = [
        migrations.RunPython(_create_triggers, _drop_triggers),
    ]
