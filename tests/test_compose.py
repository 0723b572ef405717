"""compose.yaml's structure: no Docker engine runs here, so the file is read and checked."""

from __future__ import annotations

import importlib
import shlex
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery import Celery
from celery.app.utils import find_app
from django.conf import settings

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
EXPECTED = {
    "postgres",
    "redis",
    "web",
    "worker",
    "replay-worker",
    "replay-worker-gpu",
    "beat",
    "minio",
}
#: The workers and the queue each consumes: ingest, and one replay queue per platform kind
#: that compose runs (TPU hosts start their own: docs/operators.md, "Replay queues").
WORKERS = {"worker": "ingest", "replay-worker": "replay", "replay-worker-gpu": "replay-gpu"}


def command_words(service: dict[str, Any]) -> list[str]:
    """The service's command as words, looking inside `sh -c "..."` wrappers."""
    command = service.get("command", [])
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    if words[:2] == ["sh", "-c"]:
        words = shlex.split(" ".join(words[2:]).replace("&&", " && "))
    return words


def option(words: list[str], short: str, long: str) -> str:
    for index, word in enumerate(words):
        if word in (short, long):
            return words[index + 1]
        if word.startswith(f"{long}="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{short}/{long} not in {words}")


def routed_queues() -> set[str]:
    from attestations.workers.presence import REPLAY_QUEUES

    queues = {settings.CELERY_TASK_DEFAULT_QUEUE, *REPLAY_QUEUES.values()}
    for route in settings.CELERY_TASK_ROUTES.values():
        queues.add(route["queue"])
    return queues


def test_it_has_the_services_of_the_design() -> None:
    assert set(SERVICES) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_service_has_a_health_check(name: str) -> None:
    check = SERVICES[name].get("healthcheck")
    assert check, f"{name} has no healthcheck"
    assert not check.get("disable", False)
    assert check["test"][0] in {"CMD", "CMD-SHELL"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_dependency_waits_until_healthy(name: str) -> None:
    depends_on = SERVICES[name].get("depends_on", {})
    assert isinstance(depends_on, dict), f"{name}: depends_on must name a condition"
    for dependency, rule in depends_on.items():
        assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
        assert rule["condition"] == "service_healthy", f"{name} -> {dependency}"


@pytest.mark.parametrize("name", ["web", "worker", "replay-worker", "beat"])
def test_the_platform_services_wait_for_the_database_and_the_broker(name: str) -> None:
    assert {"postgres", "redis"} <= set(SERVICES[name]["depends_on"])


@pytest.mark.parametrize("name", ["web", "worker", "replay-worker", "beat"])
def test_the_platform_image_is_built_from_platform(name: str) -> None:
    build = SERVICES[name]["build"]
    dockerfile = REPO_ROOT / build["context"] / build["dockerfile"]
    assert dockerfile.is_file()
    assert dockerfile.parent == REPO_ROOT / "platform"


def test_web_serves_the_wsgi_application_with_gunicorn() -> None:
    words = command_words(SERVICES["web"])
    assert "gunicorn" in words
    target = next(word for word in words if ":" in word and not word.startswith("-"))
    module_name, attribute = target.split(":")
    application = getattr(importlib.import_module(module_name), attribute)
    assert callable(application)
    config_file = words[words.index("--config") + 1]
    assert (REPO_ROOT / config_file).is_file()


@pytest.mark.parametrize(("name", "queue"), sorted(WORKERS.items()))
def test_workers_run_the_celery_app_on_routed_queues(name: str, queue: str) -> None:
    words = command_words(SERVICES[name])
    assert words[:1] == ["celery"] and "worker" in words
    app = find_app(option(words, "-A", "--app"))
    assert isinstance(app, Celery)
    assert app.main == "dvbench"
    queues = set(option(words, "-Q", "--queues").split(","))
    assert queues == {queue}
    assert queues <= routed_queues()


def test_every_routed_queue_has_a_worker() -> None:
    consumed = set()
    for name in WORKERS:
        consumed |= set(option(command_words(SERVICES[name]), "-Q", "--queues").split(","))
    # replay-tpu's workers run on TPU hosts, outside compose.
    assert routed_queues() - {"replay-tpu"} <= consumed


def test_replays_and_ingest_run_on_separate_workers() -> None:
    """A long replay never holds up ingest: the two queues have their own services."""
    consumed = {
        name: option(command_words(SERVICES[name]), "-Q", "--queues").split(",") for name in WORKERS
    }
    assert consumed == {name: [queue] for name, queue in WORKERS.items()}


def test_beat_sends_the_periodic_tasks_from_one_replica() -> None:
    words = command_words(SERVICES["beat"])
    assert words[:1] == ["celery"] and "beat" in words and "worker" not in words
    app = find_app(option(words, "-A", "--app"))
    assert isinstance(app, Celery) and app.main == "dvbench"
    # Its schedule state lives on a mounted volume, so a restart keeps the last run times.
    schedule = option(words, "-s", "--schedule")
    mounts = [str(volume).split(":")[1] for volume in SERVICES["beat"]["volumes"]]
    assert any(schedule.startswith(f"{mount}/") for mount in mounts), (schedule, mounts)
    assert SERVICES["beat"]["deploy"]["replicas"] == 1  # two beats would send each task twice
    tasks = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert {
        "attestations.uploads.tasks.expire_uploads",
        "attestations.challenges.tasks.expire_challenges",
    } <= tasks
    # What the worker's autodiscovery imports: every app's tasks module (run alone, this
    # test would otherwise see only the tasks other tests happened to import).
    import attestations.challenges.tasks
    import attestations.proofs.tasks
    import attestations.uploads.tasks
    import attestations.workers.tasks  # noqa: F401
    from config.celery_app import app as platform_app

    assert tasks <= set(platform_app.tasks), tasks - set(platform_app.tasks)
    # Every task it sends lands on a queue some worker consumes.
    consumed = set()
    for name in WORKERS:
        consumed |= set(option(command_words(SERVICES[name]), "-Q", "--queues").split(","))
    for task in tasks:
        route = next(
            (r for p, r in settings.CELERY_TASK_ROUTES.items() if fnmatch(task, p)),
            {"queue": settings.CELERY_TASK_DEFAULT_QUEUE},
        )
        assert route["queue"] in consumed, task


def test_the_gpu_replay_worker_reserves_a_gpu_and_the_cpu_one_none() -> None:
    devices = SERVICES["replay-worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    # A CPU-trained run is replayed where JAX and Torch see no accelerator: on a GPU host
    # the worker would be of kind gpu and refuse it (attestations.challenges.routing).
    assert "deploy" not in SERVICES["replay-worker"]


def test_object_storage_is_optional() -> None:
    assert SERVICES["minio"]["profiles"] == ["s3"]
    assert SERVICES["web"]["depends_on"]["minio"]["required"] is False


def test_the_platform_services_get_their_settings_from_the_environment() -> None:
    environment = SERVICES["web"]["environment"]
    assert environment["DATABASE_URL"].startswith("postgres://")
    assert environment["REDIS_URL"].startswith("redis://redis:")
    readme = (REPO_ROOT / "README.md").read_text()
    for variable in environment:
        if variable.startswith(("DJANGO_", "DVBENCH_", "DATABASE_", "REDIS_")):
            assert f"`{variable}`" in readme, f"{variable} is not in the README"


def test_the_dockerfile_copies_only_what_the_repository_has() -> None:
    dockerfile = (REPO_ROOT / "platform" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _destination = shlex.split(line)[1:]
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{line!r}: {source} is not in the repo"
    helper = REPO_ROOT / "platform" / "pip-install"
    assert helper.stat().st_mode & 0o111, "platform/pip-install must be executable"
