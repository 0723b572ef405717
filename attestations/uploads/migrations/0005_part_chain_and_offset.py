from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("uploads", "0004_direct_upload")]

    operations = [
        migrations.AddField(
            model_name="uploadpart",
            name="chain_base",
            field=models.BinaryField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="uploadpart",
            name="chain",
            field=models.BinaryField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="uploadpart",
            name="offset",
            field=models.PositiveBigIntegerField(
                blank=True, db_column="data_offset", editable=False, null=True
            ),
        ),
    ]
