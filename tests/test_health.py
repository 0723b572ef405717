"""``/health``: 200 with every component ok when all is well, 503 naming what is down."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from attestations.web import health

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = {"database", "broker", "storage"}
#: Ask /health through Django's test client in a fresh process with its own environment.
PROBE = """
import json, django
django.setup()
from django.test import Client
response = Client().get("/health")
print(json.dumps({"status_code": response.status_code, "body": response.json()}))
"""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health_in_subprocess(tmp_path: Path, **variables: str) -> tuple[int, dict[str, Any]]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL"))
    }
    environment.update(DJANGO_SETTINGS_MODULE="config.settings", DVBENCH_DATA_DIR=str(tmp_path))
    environment.update(variables)
    completed = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    return answer["status_code"], answer["body"]


@pytest.mark.django_db
def test_it_reports_every_component_ok(client: Client) -> None:
    response = client.get("/health")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert set(body["components"]) == COMPONENTS
    assert all(item["status"] == "ok" for item in body["components"].values())
    assert response["Cache-Control"].startswith("max-age=0")


def test_it_reports_ok_on_the_embedded_defaults(tmp_path: Path) -> None:
    status_code, body = health_in_subprocess(tmp_path)

    assert status_code == 200, body
    components = body["components"]
    assert components["database"] == {"status": "ok", "backend": "sqlite"}
    assert components["broker"] == {"status": "ok", "backend": "in-process"}
    assert components["storage"] == {"status": "ok", "backend": "FileSystemStorage"}
    assert components["storage"]["status"] == "ok"


@pytest.mark.services
@pytest.mark.django_db
def test_it_reports_ok_on_postgres_and_redis(client: Client) -> None:
    if not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        pytest.skip("needs real PostgreSQL and Redis: set DATABASE_URL and REDIS_URL")

    response = client.get("/health")

    assert response.status_code == 200, response.content
    components = response.json()["components"]
    assert components["database"]["backend"] == "postgresql"
    assert components["broker"]["status"] == "ok"
    assert components["broker"]["backend"] != "in-process"
    assert not settings.CELERY_TASK_ALWAYS_EAGER


def test_it_answers_503_naming_the_broker_when_the_broker_is_down(tmp_path: Path) -> None:
    status_code, body = health_in_subprocess(
        tmp_path, REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0"
    )

    assert status_code == 503
    assert body["status"] == "down"
    assert body["components"]["broker"]["status"] == "down"
    assert body["components"]["broker"]["error"]
    assert body["components"]["database"]["status"] == "ok"
    assert body["components"]["storage"]["status"] == "ok"


def test_it_answers_503_naming_the_database_when_the_database_is_down(tmp_path: Path) -> None:
    status_code, body = health_in_subprocess(
        tmp_path, DATABASE_URL=f"postgres://dvbench@127.0.0.1:{closed_port()}/dvbench"
    )

    assert status_code == 503
    assert body["components"]["database"]["status"] == "down"
    assert body["components"]["storage"]["status"] == "ok"


@pytest.mark.django_db
def test_it_answers_503_naming_the_storage_when_the_storage_is_down(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_save(*args: object, **kwargs: object) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(health.default_storage, "save", broken_save)

    response = client.get("/health")

    assert response.status_code == 503
    storage = response.json()["components"]["storage"]
    assert storage == {"status": "down", "error": "OSError: disk full"}


def test_it_only_allows_get(client: Client) -> None:
    assert client.post("/health").status_code == 405
