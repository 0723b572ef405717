"""Log entries in Rekor's ``dsse`` kind: the envelope, the signed entry timestamp and the
RFC 3161 timestamp.

From here on a log leaf is the canonicalized body of a Rekor ``dsse`` 0.0.1 entry
(``dvbench.attest._rekor``), which holds the envelope's hashes rather than the envelope,
so the envelope is stored beside it, and so are the log's signed entry timestamp and the
platform timestamp authority's token over the signature. Rows logged before keep these
columns empty: their leaf is the envelope, and they are never rewritten (the table is
append-only; adding a column with a default updates no row).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("certificates", "0003_certificate_tokens")]

    operations = [
        migrations.AddField(
            model_name="logentry",
            name="envelope_json",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="logentry",
            name="inclusion_promise",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="logentry",
            name="rfc3161_timestamp",
            field=models.TextField(blank=True, default=""),
        ),
    ]
