"""The audit trail is append-only in SQL too, on PostgreSQL.

``AuditEvent`` refuses updates and deletes in Python (``AppendOnlyError``), but a raw
UPDATE or DELETE from a shell or another client would still rewrite history. This
trigger refuses both, like the log tables' trigger (``certificates.0003_append_only``),
with one exception: the foreign keys may be cleared. Deleting a user or an organisation
sets ``actor`` and ``organization`` to NULL (``on_delete=SET_NULL``); the event keeps
``actor_name`` and its detail, so who did what stays readable. Every other column must
stay as it was. (TRUNCATE stays possible: it is how test databases are flushed.) SQLite
has no guard.
"""

from django.db import migrations

TABLE = "attestations_auditevent"
UNLINKABLE = ("actor_id", "organization_id")


def _create_trigger(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    kept = " - ".join(f"'{column}'" for column in UNLINKABLE)
    schema_editor.execute(
        f"""
        CREATE OR REPLACE FUNCTION dvbench_audit_append_only() RETURNS trigger AS $$
        BEGIN
            IF TG_OP = 'UPDATE'
               AND (NEW.actor_id IS NULL OR NEW.actor_id = OLD.actor_id)
               AND (NEW.organization_id IS NULL OR NEW.organization_id = OLD.organization_id)
               AND (to_jsonb(NEW) - {kept}) = (to_jsonb(OLD) - {kept}) THEN
                RETURN NEW;
            END IF;
            RAISE EXCEPTION 'table % is append-only: % is not allowed', TG_TABLE_NAME, TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END;
        $$ LANGUAGE plpgsql
        """,
        params=None,  # no placeholders: the '%' are PL/pgSQL's own
    )
    schema_editor.execute(
        f"CREATE TRIGGER {TABLE}_append_only BEFORE UPDATE OR DELETE ON {TABLE} "
        "FOR EACH ROW EXECUTE FUNCTION dvbench_audit_append_only()"
    )


def _drop_trigger(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {TABLE}_append_only ON {TABLE}")
    schema_editor.execute("DROP FUNCTION IF EXISTS dvbench_audit_append_only()")


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(_create_trigger, _drop_trigger),
    ]
