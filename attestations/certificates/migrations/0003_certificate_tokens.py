"""Certificates: a searchable ``tokens`` column, filled from each signed statement.

Regulators search certificates by claimed tokens (``tokens_min``, ``tokens_max``) as by
FLOPs; like ``flops``, the column repeats the signed ``tokens`` claim, and
``manage.py verify_log`` checks it against the signature. The table is append-only (a
PostgreSQL trigger refuses UPDATE, migration ``attestations.0004_certificates``): the
backfill of rows signed before this column existed runs with that trigger disabled for
the length of this migration's transaction, and writes nothing that the signed statement
does not say.
"""

import base64
import binascii
import json

from django.db import migrations, models

TABLE = "attestations_certificate"
TRIGGER = f"{TABLE}_append_only"


def _signed_tokens(leaf: str):
    """The signed ``tokens`` claim of a logged envelope (None when absent, not a number,
    or the leaf is not a readable envelope: the column stays empty rather than guessed)."""
    try:
        envelope = json.loads(leaf)
        statement = json.loads(base64.b64decode(envelope["payload"]))
        claims = statement.get("predicate", {}).get("claims", [])
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        return None
    for claim in claims if isinstance(claims, list) else []:
        if not isinstance(claim, dict):
            continue
        value = claim.get("value")
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if claim.get("name") == "tokens" and numeric:
            return int(value)
    return None


def backfill(apps, schema_editor):
    Certificate = apps.get_model("certificates", "Certificate")
    rows = [
        (pk, _signed_tokens(leaf))
        for pk, leaf in Certificate.objects.values_list("pk", "log_entry__leaf").iterator()
    ]
    rows = [(tokens, pk) for pk, tokens in rows if tokens is not None]
    if not rows:
        return
    postgresql = schema_editor.connection.vendor == "postgresql"
    with schema_editor.connection.cursor() as cursor:
        if postgresql:
            cursor.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER {TRIGGER}")
        try:
            cursor.executemany(f"UPDATE {TABLE} SET tokens = %s WHERE id = %s", rows)  # noqa: S608
        finally:
            if postgresql:
                cursor.execute(f"ALTER TABLE {TABLE} ENABLE TRIGGER {TRIGGER}")


class Migration(migrations.Migration):
    dependencies = [
        ("certificates", "0002_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="certificate",
            name="tokens",
            field=models.DecimalField(db_index=True, decimal_places=0, max_digits=40, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
