from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('attestations', '0007_models_moved_to_their_apps'),
    ]

    # The table was created by the attestations app's migration 0001 and keeps its name
    # (db_table): this migration moves the model's state to this app and touches no table.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='WorkerHeartbeat',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('token', models.CharField(max_length=64, unique=True)),
                        ('hostname', models.CharField(max_length=255)),
                        ('created', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'attestations_workerheartbeat',
                    },
                ),
            ],
        ),
    ]
