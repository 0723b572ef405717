"""The Celery application: configured from Django settings (``CELERY_*``), tasks autodiscovered."""

from __future__ import annotations

import os
import resource
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("dvbench")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def limit_address_space(megabytes: int) -> None:
    """Cap this process's address space (RLIMIT_AS) at ``megabytes`` MiB; 0 leaves it.

    An allocation past the cap raises ``MemoryError`` in the task that asked for it, which
    fails that task, instead of the kernel's OOM killer taking whichever process it picks.
    """
    if megabytes > 0:
        limit = megabytes * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


@worker_process_init.connect
def _limit_pool_child(**_: Any) -> None:
    from django.conf import settings

    limit_address_space(int(getattr(settings, "DVBENCH_WORKER_MEMORY_LIMIT_MB", 0)))
