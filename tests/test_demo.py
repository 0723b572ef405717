"""``manage.py demo`` (the README's first command, ``./scripts/demo``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_TIMEOUT_SECONDS = 90


@pytest.mark.django_db
def test_it_creates_a_local_admin_and_keeps_its_credentials(
    settings: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings.DVBENCH = {**settings.DVBENCH, "DATA_DIR": tmp_path}  # type: ignore[attr-defined]

    call_command("demo", "--no-serve")
    first = capsys.readouterr().out
    call_command("demo", "--no-serve")
    second = capsys.readouterr().out

    password = re.search(r"password '([^']+)'", first)
    assert password is not None
    assert f"password '{password.group(1)}'" in second
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(password.group(1))
    credentials = tmp_path / "demo-admin.json"
    assert credentials.stat().st_mode & 0o077 == 0
    # The admin can register experiments at once: it administers the demo organisation,
    # and running the demo again does not duplicate it.
    from attestations.accounts.models import Membership

    memberships = Membership.objects.filter(user=admin)
    assert [(m.organization.slug, m.role) for m in memberships] == [("demo", "admin")]


@pytest.mark.slow
def test_it_serves_the_platform_and_health_answers_ok(tmp_path: Path) -> None:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL"))
    }
    environment.update(DVBENCH_DATA_DIR=str(tmp_path / "data"), PYTHONUNBUFFERED="1")
    # Its output goes to a file that the failure shows, never to a pipe: once the test
    # stopped reading, a pipe would block the server at its 64 KiB'th byte.
    log = tmp_path / "demo.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "manage.py", "demo", "--port", "0", "--no-flow"],
            cwd=REPO_ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        url = None
        deadline = time.monotonic() + SERVE_TIMEOUT_SECONDS
        while url is None:
            found = re.search(r"serving at (http://\S+/)", log.read_text(errors="replace"))
            if found:
                url = found.group(1)
            elif server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"demo did not print its URL (exit status {server.poll()}):\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            else:
                time.sleep(0.1)

        with urllib.request.urlopen(f"{url}health", timeout=10) as response:
            assert response.status == 200
            body = json.loads(response.read())
        assert {item["status"] for item in body["components"].values()} == {"ok"}
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0


@pytest.mark.django_db
def test_it_registers_the_demo_accounts_with_working_keys_and_keeps_them(tmp_path: Path) -> None:
    from attestations.accounts.models import Access, ApiKey
    from attestations.reports.management.commands.demo import (
        ensure_admin,
        ensure_demo_accounts,
        ensure_demo_organization,
    )

    admin = ensure_admin(tmp_path)
    ensure_demo_organization(admin[0])
    first = ensure_demo_accounts(tmp_path, admin)
    second = ensure_demo_accounts(tmp_path, admin)

    assert first == second  # a rerun prints the same credentials
    assert {role: (a.username, a.organization) for role, a in first.items()} == {
        "trainer": ("trainer", "demo"),
        "auditor": ("auditor", "demo"),
        "regulator": ("regulator", "agency"),
        "admin": ("admin", "demo"),
    }
    for account in first.values():
        key = ApiKey.authenticate(account.api_key)
        assert key is not None and key.user.get_username() == account.username
        assert key.user.check_password(account.password)
    regulator = ApiKey.authenticate(first["regulator"].api_key)
    assert regulator is not None and Access.for_user(regulator.user).is_regulator
    assert (tmp_path / "demo-accounts.json").stat().st_mode & 0o077 == 0

    # A revoked key is replaced by a working one, and the file follows.
    revoked = ApiKey.authenticate(first["auditor"].api_key)
    assert revoked is not None
    revoked.revoke()
    third = ensure_demo_accounts(tmp_path, admin)
    assert third["auditor"].api_key != first["auditor"].api_key
    assert ApiKey.authenticate(third["auditor"].api_key) is not None
    stored = json.loads((tmp_path / "demo-accounts.json").read_text())
    assert stored["auditor"]["api_key"] == third["auditor"].api_key


def test_a_second_demo_on_the_same_data_directory_is_refused(
    settings: object, tmp_path: Path
) -> None:
    from django.core.management.base import CommandError

    settings.DVBENCH = {**settings.DVBENCH, "DATA_DIR": tmp_path}  # type: ignore[attr-defined]
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "demo.json").write_text(
            json.dumps({"pid": earlier.pid, "url": "http://127.0.0.1:8000"})
        )
        with pytest.raises(
            CommandError, match=rf"earlier demo is still running \(pid {earlier.pid}"
        ):
            call_command("demo", "--port", "0")
    finally:
        earlier.kill()
        earlier.wait()
    # Once that process is gone, its record no longer blocks anything.
    from attestations.reports.management.commands.demo import refuse_second_demo

    refuse_second_demo(tmp_path)


def test_a_taken_port_is_replaced_by_a_free_one() -> None:
    import socket

    from attestations.reports.management.commands.demo import free_port

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        chosen = free_port("127.0.0.1", taken)
    assert chosen != taken and chosen > 0
