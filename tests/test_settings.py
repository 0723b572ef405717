"""Settings come from the environment; a value that cannot be understood fails loudly.

Each test executes ``config/settings.py`` afresh (``runpy.run_path``) under a controlled
environment, which leaves the settings this test session runs on untouched.
"""

from __future__ import annotations

import os
import runpy
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Prefixes of every variable the settings read; cleared so the host cannot leak in.
PREFIXES = ("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DVBENCH_DATA_DIR", str(tmp_path / "data"))
    return monkeypatch


def load_settings() -> dict[str, Any]:
    return runpy.run_path(str(REPO_ROOT / "config" / "settings.py"), run_name="settings_under_test")


def test_embedded_defaults_are_sqlite_in_process_tasks_and_local_files(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loaded = load_settings()

    data_dir = (tmp_path / "data").resolve()
    database = loaded["DATABASES"]["default"]
    assert database["ENGINE"] == "django.db.backends.sqlite3"
    assert Path(database["NAME"]).parent == data_dir
    assert loaded["CELERY_TASK_ALWAYS_EAGER"] is True
    assert loaded["CELERY_BROKER_URL"] == "memory://"
    storage = loaded["STORAGES"]["default"]
    assert storage["BACKEND"] == "django.core.files.storage.FileSystemStorage"
    assert Path(storage["OPTIONS"]["location"]).is_relative_to(data_dir)
    assert loaded["DEBUG"] is False


def test_the_generated_secret_key_is_kept_private_and_reused(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first = load_settings()["SECRET_KEY"]
    second = load_settings()["SECRET_KEY"]

    assert first == second
    assert len(first) >= 50
    mode = stat.S_IMODE((tmp_path / "data" / "secret_key").stat().st_mode)
    assert mode == 0o600


def test_services_are_postgres_redis_and_a_real_worker(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(
        "DATABASE_URL", "postgres://dv:s%40cret@db.example:6543/dvbench?sslmode=require"
    )
    clean_env.setenv("REDIS_URL", "redis://broker.example:6379/2")

    loaded = load_settings()

    database = loaded["DATABASES"]["default"]
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert (database["NAME"], database["USER"], database["PASSWORD"]) == ("dvbench", "dv", "s@cret")
    assert (database["HOST"], database["PORT"]) == ("db.example", "6543")
    # psycopg's own default: a statement is prepared on its fifth run (server-binding
    # cursors only; attestations.core.db.prepared_cursor).
    assert database["OPTIONS"] == {"sslmode": "require", "prepare_threshold": 5}
    assert loaded["CELERY_BROKER_URL"] == "redis://broker.example:6379/2"
    assert loaded["CELERY_TASK_ALWAYS_EAGER"] is False


@pytest.mark.parametrize(("query", "threshold"), [("none", None), ("OFF", None), ("0", 0)])
def test_prepared_statements_can_be_turned_off_or_made_eager(
    clean_env: pytest.MonkeyPatch, query: str, threshold: int | None
) -> None:
    clean_env.setenv("DATABASE_URL", f"postgres://db.example/dvbench?prepare_threshold={query}")

    options = load_settings()["DATABASES"]["default"]["OPTIONS"]

    assert options == {"prepare_threshold": threshold}


def test_the_broker_visibility_timeout_outlasts_the_longest_task(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("DVBENCH_TASK_TIME_LIMIT", "7200")

    loaded = load_settings()

    assert loaded["CELERY_TASK_TIME_LIMIT"] == 7200
    assert loaded["CELERY_TASK_SOFT_TIME_LIMIT"] < 7200
    assert loaded["CELERY_BROKER_TRANSPORT_OPTIONS"]["visibility_timeout"] > 7200
    assert loaded["CELERY_WORKER_PREFETCH_MULTIPLIER"] == 1
    assert loaded["CELERY_TASK_ACKS_LATE"] is False  # opted into per idempotent task


def test_pool_children_are_replaced_past_their_resident_memory(
    clean_env: pytest.MonkeyPatch,
) -> None:
    loaded = load_settings()
    assert loaded["CELERY_WORKER_MAX_MEMORY_PER_CHILD"] == 4096 * 1024  # KiB
    assert loaded["DVBENCH_WORKER_MEMORY_LIMIT_MB"] == 0  # the hard cap is the operator's
    clean_env.setenv("DVBENCH_WORKER_MAX_RSS_MB", "512")
    clean_env.setenv("DVBENCH_WORKER_MEMORY_LIMIT_MB", "8192")
    loaded = load_settings()
    assert loaded["CELERY_WORKER_MAX_MEMORY_PER_CHILD"] == 512 * 1024
    assert loaded["DVBENCH_WORKER_MEMORY_LIMIT_MB"] == 8192


def test_s3_storage_is_chosen_by_a_bucket_name(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DVBENCH_S3_BUCKET", "dvbench")
    clean_env.setenv("DVBENCH_S3_ENDPOINT_URL", "http://minio:9000")

    storage = load_settings()["STORAGES"]["default"]

    assert storage["BACKEND"] == "storages.backends.s3.S3Storage"
    assert storage["OPTIONS"]["bucket_name"] == "dvbench"
    assert storage["OPTIONS"]["endpoint_url"] == "http://minio:9000"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DJANGO_DEBUG", "maybe"),
        ("DJANGO_SECRET_KEY", "too-short"),
        ("DATABASE_URL", "mysql://x/dvbench"),
        ("DATABASE_URL", "postgres://db.example"),
        ("DATABASE_URL", "postgres://db.example:99999/dvbench"),
        ("REDIS_URL", "http://x"),
        ("DVBENCH_EAGER_TASKS", "sometimes"),
        ("DVBENCH_TASK_TIME_LIMIT", "1"),
        ("DVBENCH_WORKER_MAX_RSS_MB", "-1"),
        ("DVBENCH_WORKER_MEMORY_LIMIT_MB", "lots"),
        ("DVBENCH_MAX_PART_BYTES", "abc"),
        ("DVBENCH_MAX_BLOB_BYTES", "1.5"),
        ("DVBENCH_DETECTION_TARGET", "high"),
        ("DVBENCH_DETECTION_TARGET", "1.5"),
        ("DVBENCH_FORGED_FRACTION", "nan"),
        ("DVBENCH_HSTS_SECONDS", "-1"),
        ("DVBENCH_SECURE_COOKIES", "2"),
        ("DVBENCH_LOG_LEVEL", "LOUD"),
        ("DVBENCH_CHALLENGE_KEY", "not a hex key"),
        ("DVBENCH_CHALLENGE_KEY", "ab" * 31),
        ("DATABASE_URL", "postgres://db.example/dvbench?prepare_threshold=-1"),
        ("DATABASE_URL", "postgres://db.example/dvbench?prepare_threshold=often"),
    ],
)
def test_a_bad_value_raises_improperly_configured_naming_the_variable(
    clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_env.setenv(name, value)

    with pytest.raises(ImproperlyConfigured, match=name):
        load_settings()


def test_a_bad_value_stops_manage_py(tmp_path: Path) -> None:
    environment = {key: value for key, value in os.environ.items() if not key.startswith(PREFIXES)}
    environment.update(DVBENCH_DATA_DIR=str(tmp_path), DVBENCH_MAX_PART_BYTES="abc")

    completed = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )

    assert completed.returncode != 0
    assert "ImproperlyConfigured" in completed.stderr
    assert "DVBENCH_MAX_PART_BYTES" in completed.stderr


def test_every_variable_the_settings_read_is_documented_in_the_readme() -> None:
    import re

    source = (REPO_ROOT / "config" / "settings.py").read_text()
    read = set(re.findall(r"env(?:str|bool|int|float|list|choice)\(\s*\"([A-Z0-9_]+)\"", source))
    read |= set(re.findall(r"os\.environ(?:\.get)?[\[(]\s*\"([A-Z0-9_]+)\"", source))
    readme = (REPO_ROOT / "README.md").read_text()
    undocumented = sorted(name for name in read if f"`{name}`" not in readme)
    assert read, "found no environment variable in config/settings.py"
    assert not undocumented, f"README.md's configuration reference lacks {undocumented}"
