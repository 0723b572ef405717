from django.db import migrations


def relabel(apps, schema_editor):
    content_type = apps.get_model("contenttypes", "ContentType")
    content_type.objects.filter(app_label="attestations", model="workerheartbeat").update(
        app_label="workers"
    )


def unlabel(apps, schema_editor):
    content_type = apps.get_model("contenttypes", "ContentType")
    content_type.objects.filter(app_label="workers", model="workerheartbeat").update(
        app_label="attestations"
    )


class Migration(migrations.Migration):

    dependencies = [
        ('attestations', '0007_models_moved_to_their_apps'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('workers', '0001_initial'),
    ]

    # The last model of this app, the worker heartbeat, now lives in attestations.workers
    # over the same table: this app forgets it in its state only (as 0007 did for the
    # others), and its content type follows it.
    operations = [
        migrations.RunPython(relabel, unlabel, elidable=False),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(
                    name='WorkerHeartbeat',
                ),
            ],
        ),
    ]
