"""Which replay workers are alive, and which platform kinds they serve.

Every platform kind has its own replay queue (:data:`REPLAY_QUEUES`: ``replay`` is the
CPU's, ``replay-gpu`` and ``replay-tpu`` the accelerators'), so a run is replayed on
workers of the kind it trained on (``zkdv.environments``). A worker announces itself
(:func:`announce`) when it starts (Celery's ``worker_ready``, connected in this app's
``ready()``), every minute after that (on its consumer's timer), and after each replay,
with the replay environment it ran in; it withdraws when it shuts down. The presence
task (:data:`PRESENCE_TASK`), sent by hand to a replay queue, has the worker that takes
it announce itself too: a check that a queue has a live consumer. :func:`serves`
says whether a kind has a live worker: one seen within ``DVBENCH["REPLAY_WORKER_TTL"]``
seconds, or, where tasks run in the calling process (the embedded default), the kinds
``DVBENCH["REPLAY_IN_PROCESS_KINDS"]`` names.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.utils import timezone

from attestations.workers.models import ReplayWorker

__all__ = [
    "PRESENCE_TASK",
    "REPLAY_QUEUES",
    "announce",
    "kind_of_queue",
    "library_versions",
    "queue_for",
    "serves",
    "withdraw",
]

#: The replay queue of each platform kind (``zkdv.environments.PLATFORM_KINDS``).
REPLAY_QUEUES: Mapping[str, str] = {"cpu": "replay", "gpu": "replay-gpu", "tpu": "replay-tpu"}
#: A task that has the worker taking it from a replay queue announce itself.
PRESENCE_TASK = "attestations.workers.tasks.replay_presence"


def queue_for(kind: str) -> str:
    """The replay queue of platform ``kind`` (``replay-<kind>`` for a kind not listed)."""
    return REPLAY_QUEUES.get(kind, f"replay-{kind}")


def kind_of_queue(queue: str) -> str | None:
    """The platform kind a replay queue serves; None for a queue that is not one."""
    for kind, name in REPLAY_QUEUES.items():
        if name == queue:
            return kind
    if queue.startswith("replay-") and len(queue) > len("replay-"):
        return queue[len("replay-") :]
    return None


def library_versions() -> dict[str, str]:
    """The replay libraries installed here, read without importing them: a worker's main
    process must not open an accelerator that its pool's processes will need."""
    found: dict[str, str] = {}
    for name in ("jax", "jaxlib", "libtpu", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def announce(
    hostname: str, queues: Iterable[str], environment: Mapping[str, Any] | None = None
) -> list[str]:
    """Record that ``hostname`` consumes ``queues`` now; returns the kinds it serves.

    Queues that are not replay queues are ignored. ``environment`` replaces what the row
    says the worker replays with (kept when None).
    """
    now = timezone.now()
    kinds = []
    for queue in sorted(set(queues)):
        kind = kind_of_queue(queue)
        if kind is None:
            continue
        defaults: dict[str, Any] = {"kind": kind, "last_seen": now}
        if environment is not None:
            defaults["environment"] = dict(environment)
        ReplayWorker.objects.update_or_create(hostname=hostname, queue=queue, defaults=defaults)
        kinds.append(kind)
    return kinds


def withdraw(hostname: str) -> int:
    """Forget ``hostname``'s queues (it shut down); returns how many rows went."""
    deleted, _ = ReplayWorker.objects.filter(hostname=hostname).delete()
    return deleted


def serves(kind: str, now: Any = None) -> bool:
    """Whether a live worker replays runs of platform ``kind`` (module docstring)."""
    if current_app.conf.task_always_eager and kind in settings.DVBENCH["REPLAY_IN_PROCESS_KINDS"]:
        return True
    since = (now or timezone.now()) - timedelta(seconds=settings.DVBENCH["REPLAY_WORKER_TTL"])
    return ReplayWorker.objects.filter(kind=kind, last_seen__gte=since).exists()
