"""Certificates: a searchable ``lineage_flops`` column, filled from each signed statement.

The column repeats the signed ``lineage`` claim's total (the run's FLOPs and its parent
runs'), which regulators search (``lineage_flops_min``, the lineage thresholds) and
``manage.py verify_log`` checks against the signature. Certificates signed before the
claim existed have none and keep NULL; any row whose statement carries the claim gets its
total, written with the append-only trigger disabled for this transaction only, as
``0003_certificate_tokens`` did for ``tokens``.
"""

import base64
import binascii
import json

from django.db import migrations, models

TABLE = "attestations_certificate"
TRIGGER = f"{TABLE}_append_only"


def _signed_total(envelope_text: str):
    """The signed ``lineage`` claim's total of a logged envelope (None when absent, not a
    number, or the text is not a readable envelope: the column stays empty)."""
    try:
        envelope = json.loads(envelope_text)
        statement = json.loads(base64.b64decode(envelope["payload"]))
        claims = statement.get("predicate", {}).get("claims", [])
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        return None
    for claim in claims if isinstance(claims, list) else []:
        if not isinstance(claim, dict) or claim.get("name") != "lineage":
            continue
        value = claim.get("value")
        total = value.get("flops") if isinstance(value, dict) else None
        if isinstance(total, int | float) and not isinstance(total, bool):
            return int(total)
    return None


def backfill(apps, schema_editor):
    Certificate = apps.get_model("certificates", "Certificate")
    found = Certificate.objects.values_list(
        "pk", "log_entry__envelope_json", "log_entry__leaf"
    ).iterator()
    rows = [(_signed_total(envelope or leaf), pk) for pk, envelope, leaf in found]
    rows = [(total, pk) for total, pk in rows if total is not None]
    if not rows:
        return
    postgresql = schema_editor.connection.vendor == "postgresql"
    with schema_editor.connection.cursor() as cursor:
        if postgresql:
            cursor.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER {TRIGGER}")
        try:
            cursor.executemany(f"UPDATE {TABLE} SET lineage_flops = %s WHERE id = %s", rows)  # noqa: S608
        finally:
            if postgresql:
                cursor.execute(f"ALTER TABLE {TABLE} ENABLE TRIGGER {TRIGGER}")


class Migration(migrations.Migration):
    dependencies = [
        ("certificates", "0004_log_entry_dsse"),
    ]

    operations = [
        migrations.AddField(
            model_name="certificate",
            name="lineage_flops",
            field=models.DecimalField(db_index=True, decimal_places=0, max_digits=40, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
