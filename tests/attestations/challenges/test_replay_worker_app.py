"""The Celery app of the worker-kill test's workers: the platform's, sweeping faster.

Redis keeps a delivered but unacknowledged message aside until its visibility timeout
passes; a worker then restores it in a sweep that by default runs about every 100 s.
The kill test's workers sweep every second so that the redelivery after SIGKILL takes
seconds, not minutes.

``DVBENCH_REPLAY_TEST_DELAY`` (seconds) makes a replay pause after its challenge is
claimed, before it replays: it gives the test a moment in which the challenge is claimed
but not finished. The pause is this module's, wrapped around
``attestations.challenges.execution.replay_one`` in the test's workers only; production code
has no such hook. Nothing else differs from ``config.celery_app``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from celery.signals import task_prerun

from config.celery_app import app

app.conf.broker_transport_options = {
    **(app.conf.broker_transport_options or {}),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}


def _test_delay() -> float:
    try:
        return max(0.0, float(os.environ.get("DVBENCH_REPLAY_TEST_DELAY", "0") or 0))
    except ValueError:
        return 0.0


@task_prerun.connect
def _pause_replays(**kwargs: Any) -> None:
    """Wrap the replay with the pause before the first task runs (Django is set up then)."""
    delay = _test_delay()
    if not delay:
        return
    from attestations.challenges import execution

    if getattr(execution.replay_one, "paused_for_tests", False):
        return

    replay_one = execution.replay_one

    @functools.wraps(replay_one)
    def paused(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay)
        return replay_one(*args, **kwargs)

    paused.paused_for_tests = True  # type: ignore[attr-defined]
    execution.replay_one = paused  # type: ignore[assignment]


__all__ = ["app"]
