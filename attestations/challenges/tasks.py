"""Celery tasks of challenges: replay one, and expire those left unanswered.

Thin wrappers that pass ids, claim, then delegate to :mod:`~attestations.challenges.execution`
and :mod:`~attestations.challenges.verdicts`.
Each task is named after this module (``attestations.challenges.tasks.<function>``), the
name its senders, the routes (``config/settings.py``) and the beat schedule use.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from celery import Task, shared_task
from django.conf import settings

import provers
from attestations.challenges import execution, routing, sliced, sliced_verdicts, verdicts
from attestations.challenges.answers import REPLAY_TASK
from attestations.challenges.models import Challenge, SlicedChallenge
from attestations.challenges.workspace import BlobCorruptError
from attestations.core.transient import TRANSIENT_ERRORS
from attestations.workers.presence import announce

log = logging.getLogger(__name__)


def _run_claimed(
    task: Task,  # type: ignore[type-arg]
    pk: int,
    work: Callable[[], object],
    *,
    what: str,
    record_error: Callable[[int, str, str], None],
    release_claim: Callable[[int], None],
) -> None:
    """Run ``work`` on a row this worker claimed; a failure becomes its error or a retry.

    Transient errors (database, broker, disk) release the claim and retry with
    exponential backoff, and after the last retry record ``replay_unavailable``; a
    corrupt stored file, the soft time limit and anything else are recorded on the row
    as a permanent error with its reason.
    """
    from celery.exceptions import SoftTimeLimitExceeded

    try:
        work()
    except BlobCorruptError as error:
        record_error(pk, "blob_corrupt", str(error))
    except SoftTimeLimitExceeded:
        record_error(pk, "replay_timeout", f"the {what} ran past the task's soft time limit")
    except TRANSIENT_ERRORS as error:
        release_claim(pk)
        if task.request.retries >= (task.max_retries or 0):
            record_error(pk, "replay_unavailable", f"{type(error).__name__}: {error}")
            raise
        raise task.retry(
            exc=error,  # type: ignore[arg-type]
            countdown=min(300, 2 ** (task.request.retries + 1)),
        ) from error
    except Exception as error:
        log.exception("the %s of %s failed", what, pk)
        record_error(pk, "replay_failed", f"{type(error).__name__}: {error}")


@shared_task(
    bind=True,
    name=REPLAY_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=5,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def replay_challenge(self: Task, challenge_id: int) -> str | None:  # type: ignore[type-arg]
    """Replay one challenge and record its verdict (the replay queue of its run's
    platform kind: ``replay``, ``replay-gpu``, ``replay-tpu``; ``routing.py``).

    Keyed by the challenge: it is claimed with a conditional update (ready -> replaying,
    or a stale ``replaying`` claim whose worker died), so a redelivered message or a
    second worker finds nothing to do. Late acknowledgement with reject-on-worker-lost
    means a worker killed mid-replay leaves the message to the broker, which delivers it
    again once the claim is stale. Failures are handled by :func:`_run_claimed`: transient
    ones retry, anything else is recorded on the challenge as a permanent ``error``.

    Returns:
        The challenge's final status, or None when another worker owns it.
    """
    if not execution.claim(challenge_id):
        return None

    def replay() -> None:
        challenge = Challenge.objects.select_related("proof__transcript", "proof__experiment").get(
            pk=challenge_id
        )
        verdict = execution.replay_one(challenge)
        if execution.UNREPLAYED in verdict:
            routing.record_unreplayed([challenge_id], str(verdict[execution.UNREPLAYED]))
            return
        if verdict.get("reason") == provers.INEXACT_ENVIRONMENT:
            # A run without gradient files, on a worker of another environment: this
            # worker cannot tell its rounding from a forgery (provers.judge).
            routing.record_unreplayed([challenge_id], str(verdict.get("message") or ""))
            return
        execution.record_verdict(challenge, verdict)
        _announce(self, verdict.get("environment"))

    _run_claimed(
        self,
        challenge_id,
        replay,
        what="replay",
        record_error=execution.record_error,
        release_claim=execution.release_claim,
    )
    return str(Challenge.objects.values_list("status", flat=True).get(pk=challenge_id))


def _announce(task: Task, environment: Any) -> None:  # type: ignore[type-arg]
    """A worker that replayed announces itself on the queue it took the task from, with
    the replay environment it ran in (nothing to announce for an in-process run)."""
    queue = (task.request.delivery_info or {}).get("routing_key")
    if queue and isinstance(environment, dict):
        announce(task.request.hostname or socket.gethostname(), [str(queue)], environment)


@shared_task(name="attestations.challenges.tasks.expire_challenges", acks_late=True)
def expire_challenges() -> int:
    """Expire challenges left unanswered past their deadline (run periodically).

    Each expiry rejects its proof (``challenge_expired``); the unanswered slices of sliced
    runs past their deadline expire too, and fail their run. Idempotent: an expired
    challenge is final and is not touched again.
    """
    return verdicts.expire() + sliced_verdicts.expire()


@shared_task(
    bind=True,
    name=sliced.VERIFY_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=5,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def replay_slice(self: Task, slice_id: int) -> str | None:  # type: ignore[type-arg]
    """Verify one sliced challenge and record its verdict (queue ``replay``).

    Claimed like :func:`replay_challenge` (ready -> verifying, or a stale claim), with the
    same handling of transient errors, time limits and anything else (:func:`_run_claimed`).
    """
    if not sliced_verdicts.claim(slice_id):
        return None

    def check() -> None:
        challenge = SlicedChallenge.objects.select_related("run__experiment", "opening").get(
            pk=slice_id
        )
        sliced_verdicts.record_verdict(slice_id, sliced_verdicts.verify(challenge))

    _run_claimed(
        self,
        slice_id,
        check,
        what="slice check",
        record_error=sliced_verdicts.record_error,
        release_claim=sliced_verdicts.release_claim,
    )
    return str(SlicedChallenge.objects.values_list("status", flat=True).get(pk=slice_id))
