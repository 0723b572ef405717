"""``manage.py createuser``: how the guides' readers get an account on a real platform."""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import CommandError, call_command

from attestations.audit.models import AuditEvent

pytestmark = pytest.mark.django_db


def test_createuser_prints_a_one_time_password_that_signs_in() -> None:
    out = io.StringIO()
    call_command("createuser", "newauditor", "--email", "a@example.org", stdout=out)
    printed = out.getvalue()
    assert printed.startswith("created user newauditor\n")
    found = re.search(r"password \(shown once\): (\S+)", printed)
    assert found is not None, printed
    user = authenticate(username="newauditor", password=found.group(1))
    assert user is not None and user.email == "a@example.org"
    assert not user.is_staff and not user.is_superuser
    assert AuditEvent.objects.filter(action="user.created", target_id=str(user.pk)).exists()
    # A second account of that name, in any case, is refused and changes nothing.
    with pytest.raises(CommandError, match="a user named 'NewAuditor' exists already"):
        call_command("createuser", "NewAuditor", stdout=io.StringIO())
    assert get_user_model().objects.filter(username__iexact="newauditor").count() == 1


def test_createuser_takes_a_password_on_stdin_and_applies_the_password_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("correct horse battery staple\n"))
    out = io.StringIO()
    call_command("createuser", "bob", "--password-stdin", stdout=out)
    assert "shown once" not in out.getvalue()
    assert authenticate(username="bob", password="correct horse battery staple") is not None
    monkeypatch.setattr("sys.stdin", io.StringIO("bob\n"))
    with pytest.raises(CommandError, match="password"):
        call_command("createuser", "bob2", "--password-stdin", stdout=io.StringIO())
    assert not get_user_model().objects.filter(username="bob2").exists()
    with pytest.raises(CommandError):
        call_command("createuser", "not a name!", stdout=io.StringIO())
