"""Every platform task is named after the module it lives in, so a name in a queued message,
a route or the beat schedule says where to read the task."""

from __future__ import annotations

from fnmatch import fnmatch

import pytest
from django.conf import settings

# What the worker's autodiscovery imports: every app's tasks module.
import attestations.certificates.tasks
import attestations.challenges.tasks
import attestations.proofs.tasks
import attestations.uploads.tasks
import attestations.workers.tasks  # noqa: F401
from config.celery_app import app

PLATFORM_TASKS = sorted(
    name for name, task in app.tasks.items() if task.__module__.startswith("attestations.")
)


def test_it_finds_the_platform_tasks() -> None:
    assert len(PLATFORM_TASKS) >= 9, PLATFORM_TASKS


@pytest.mark.parametrize("name", PLATFORM_TASKS)
def test_a_task_is_named_after_its_module(name: str) -> None:
    task = app.tasks[name]
    assert name == f"{task.__module__}.{task.__name__}"


@pytest.mark.parametrize("pattern", sorted(settings.CELERY_TASK_ROUTES))
def test_every_route_names_a_task(pattern: str) -> None:
    assert any(fnmatch(name, pattern) for name in PLATFORM_TASKS), pattern


def test_the_replay_tasks_default_to_the_replay_queue() -> None:
    replay_tasks = [name for name in PLATFORM_TASKS if name.rpartition(".")[2].startswith("replay")]
    assert len(replay_tasks) == 3, replay_tasks
    for name in replay_tasks:
        queues = [r["queue"] for p, r in settings.CELERY_TASK_ROUTES.items() if fnmatch(name, p)]
        assert queues == ["replay"], name
