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
    from attestations.models import Membership

    memberships = Membership.objects.filter(user=admin)
    assert [(m.organization.slug, m.role) for m in memberships] == [("demo", "admin")]


@pytest.mark.slow
def test_it_serves_the_platform_and_health_answers_ok(tmp_path: Path) -> None:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL"))
    }
    environment.update(DVBENCH_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--port", "0", "--no-flow"],
        cwd=REPO_ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + SERVE_TIMEOUT_SECONDS
        assert server.stdout is not None
        for line in server.stdout:
            found = re.search(r"serving at (http://\S+/)", line)
            if found:
                url = found.group(1)
                break
            assert time.monotonic() < deadline, "demo did not print its URL in time"
        assert url, f"demo exited ({server.wait()}) without printing its URL"

        with urllib.request.urlopen(f"{url}health", timeout=10) as response:
            assert response.status == 200
            body = json.loads(response.read())
        assert {item["status"] for item in body["components"].values()} == {"ok"}
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
