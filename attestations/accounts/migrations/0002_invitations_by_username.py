# Invitations are to a username (issue 34): one to a name nobody holds, or to a regulator,
# is answered and listed like any other but has no user, so the inviter learns nothing.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def copy_usernames(apps, schema_editor):
    Invitation = apps.get_model("accounts", "Invitation")
    for invitation in Invitation.objects.select_related("user").iterator():
        invitation.username = invitation.user.username
        invitation.save(update_fields=["username"])


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="invitation",
            name="one_pending_invitation",
        ),
        migrations.AddField(
            model_name="invitation",
            name="username",
            field=models.CharField(default="", max_length=150),
            preserve_default=False,
        ),
        migrations.RunPython(copy_usernames, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="invitation",
            name="user",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="invitations",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.AddConstraint(
            model_name="invitation",
            constraint=models.UniqueConstraint(
                condition=models.Q(("status", "pending")),
                fields=("organization", "username"),
                name="one_pending_invitation_per_username",
            ),
        ),
    ]
