"""``manage.py createuser``: the operator's way to give someone an account.

Accounts are the operator's to make (there is no public sign-up); what an account may
read or do comes afterwards, from the organisations that invite it (a lab admin invites
a username with a role, the user accepts on the dashboard) or, for regulators, from the
operator's ``manage.py agency grant``.

    manage.py createuser alice --email alice@example.org     # prints a one-time password
    printf '%s' "$PASSWORD" | manage.py createuser bob --password-stdin

The printed password is random (160 bits) and shown once; the user changes it after
signing in. The account is created in the audit trail (actor: none, the operator).
"""

from __future__ import annotations

import secrets
import sys
from typing import Any

from django.contrib.auth import get_user_model, password_validation
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from attestations.audit.models import AuditEvent


class Command(BaseCommand):
    help = "Create a user account (no organisation: a lab invites it, or `agency grant`)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--email", default="", help="the user's email address")
        parser.add_argument(
            "--password-stdin",
            action="store_true",
            help="read the password from standard input instead of generating one",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        username: str = options["username"]
        generated = not options["password_stdin"]
        password = secrets.token_urlsafe(20) if generated else sys.stdin.read().rstrip("\n")
        user = user_model(username=username, email=options["email"])
        try:
            user.full_clean(exclude=["password"])
            password_validation.validate_password(password, user)
        except ValidationError as error:
            raise CommandError(" ".join(error.messages)) from None
        user.set_password(password)
        with transaction.atomic():
            if user_model.objects.filter(username__iexact=username).exists():
                raise CommandError(f"a user named {username!r} exists already")
            user.save()
            AuditEvent.record(
                "user.created", actor=None, target=user, detail={"username": username}
            )
        self.stdout.write(f"created user {username}")
        if generated:
            self.stdout.write(f"password (shown once): {password}")
