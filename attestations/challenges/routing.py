"""Where a challenge is replayed: on a worker of the platform kind its run trained on.

A run's platform kind (``cpu``, ``gpu``, ``tpu``) is read from its root record
(:func:`zkdv.environments.platform_kind`), and its replays go to that kind's queue
(:data:`~attestations.workers.presence.REPLAY_QUEUES`: ``replay``, ``replay-gpu``,
``replay-tpu``). A CPU is no sound replay platform for an accelerator's run: the honest
difference between their gradients is wider than any bound that would still stop a
forger (``docs/soundness.md``). So :func:`route`:

* a kind with a live worker (:func:`~attestations.workers.presence.serves`): its queue;
* otherwise, where the operator allows it for that kind (``DVBENCH_REPLAY_CROSS_KIND``,
  off by default), the CPU's ``replay`` queue, where the prover judges the replay within
  the run's gradient bounds (the environment differs) and the certificate says so;
* otherwise no worker: where tasks run in the calling process nothing will ever take
  the challenge, so it is recorded ``unreplayed`` at once, reason ``no_replay_worker``
  (:func:`record_unreplayed`); with a broker it waits on its kind's queue for a worker
  to start, and the periodic sweep (``verdicts.requeue_lost``) records it ``unreplayed``
  once it has waited past twice the task time limit with none alive.

An unreplayed challenge has no replay verdict: the proof is settled on the others, and
the certificate states which steps were not replayed, why, and no replay-based detection
guarantee for them (``docs/certificates.md``). A worker that took a challenge of another
kind (a CPU host started on ``replay-tpu``) replays nothing: :func:`misrouted`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.models import Challenge, ChallengeStatus
from attestations.proofs.models import Proof
from attestations.workers.presence import queue_for, serves
from zkdv.environments import platform_kind

__all__ = [
    "NO_REPLAY_WORKER",
    "Route",
    "misrouted",
    "record_unreplayed",
    "route",
    "run_kind",
]

#: The reason of a challenge no worker of its run's platform kind could replay.
NO_REPLAY_WORKER = "no_replay_worker"


@dataclass(frozen=True)
class Route:
    """Where a run's replays go.

    Attributes:
        kind: the platform kind the run trained on.
        queue: the replay queue; None when no worker serves the kind.
        cross_kind: replayed on another kind's workers (the CPU's), within bounds.
    """

    kind: str
    queue: str | None
    cross_kind: bool = False


def run_kind(proof: Proof) -> str:
    """The platform kind ``proof``'s run trained on, from its stored root record."""
    root = (proof.report or {}).get("root")
    return platform_kind(root if isinstance(root, Mapping) else {})


def _cross_kind_allowed(kind: str) -> bool:
    return kind != "cpu" and kind in settings.DVBENCH["REPLAY_CROSS_KIND"]


def route(proof: Proof) -> Route:
    """The queue of ``proof``'s replays (module docstring), decided now."""
    kind = run_kind(proof)
    if serves(kind):
        return Route(kind, queue_for(kind))
    if _cross_kind_allowed(kind) and serves("cpu"):
        return Route(kind, queue_for("cpu"), cross_kind=True)
    return Route(kind, None)


def queue_or_unreplayed(proof: Proof, challenge_ids: list[int]) -> str | None:
    """The queue to send ``challenge_ids`` to, or None after recording them unreplayed.

    Without a live worker of the kind, a broker keeps the messages on the kind's own
    queue for a worker to come; tasks run in the calling process have nobody to wait for.
    """
    chosen = route(proof)
    if chosen.queue is not None:
        return chosen.queue
    if current_app.conf.task_always_eager:
        record_unreplayed(challenge_ids, _no_worker_message(chosen.kind))
        return None
    return queue_for(chosen.kind)


def _no_worker_message(kind: str) -> str:
    return (
        f"no replay worker serves platform kind {kind!r} (queue {queue_for(kind)!r}), "
        "so the step was not replayed; a CPU replay is allowed for it only where the "
        "operator sets DVBENCH_REPLAY_CROSS_KIND"
    )


def expire_unserved(challenge_ids: Iterable[int]) -> list[int]:
    """Record unreplayed the lost challenges whose run's kind still has no worker.

    Returns:
        The ids left to queue again (their kind has a worker, or may cross to the CPU).
    """
    left: list[int] = []
    rows = Challenge.objects.filter(pk__in=list(challenge_ids)).select_related("proof")
    by_proof: dict[int, tuple[Proof, list[int]]] = {}
    for challenge in rows:
        by_proof.setdefault(challenge.proof_id, (challenge.proof, []))[1].append(challenge.pk)
    for proof, ids in by_proof.values():
        chosen = route(proof)
        if chosen.queue is None:
            record_unreplayed(ids, _no_worker_message(chosen.kind))
        else:
            left.extend(ids)
    return left


def misrouted(proof: Proof, worker: Mapping[str, Any]) -> str | None:
    """Why this worker must not replay ``proof``'s challenge; None when it may.

    A worker of another platform kind than the run's judges only within bounds, which
    the operator must have allowed for the run's kind (module docstring).
    """
    kind = run_kind(proof)
    here = str(worker.get("platform_kind") or "cpu")
    if here == kind or (here == "cpu" and _cross_kind_allowed(kind)):
        return None
    return (
        f"the run trained on platform kind {kind!r} and this worker replays on {here!r}; "
        f"a replay of another kind is not allowed for it (queue {queue_for(kind)!r} is "
        "for its own kind's workers)"
    )


def record_unreplayed(challenge_ids: Iterable[int], message: str) -> int:
    """Record challenges as not replayed (``unreplayed``, :data:`NO_REPLAY_WORKER`).

    From ``ready`` or ``replaying`` (a worker that found itself of the wrong kind);
    each proof is then settled on its other challenges. Returns how many were recorded.
    """
    from attestations.challenges.verdicts import progress, settle

    ids = list(challenge_ids)
    count = 0
    proofs = sorted(set(Challenge.objects.filter(pk__in=ids).values_list("proof_id", flat=True)))
    for proof_id in proofs:
        with transaction.atomic():
            rows = Challenge.objects.filter(
                pk__in=ids,
                proof_id=proof_id,
                status__in=[ChallengeStatus.READY, ChallengeStatus.REPLAYING],
            )
            steps = sorted(rows.values_list("step", flat=True))
            done = rows.update(
                status=ChallengeStatus.UNREPLAYED,
                reason=NO_REPLAY_WORKER,
                message=message,
                finished=timezone.now(),
            )
            if not done:
                continue
            count += done
            proof = Proof.objects.select_related("experiment__owner").get(pk=proof_id)
            AuditEvent.record(
                "challenge.unreplayed",
                organization=proof.experiment.owner,
                target=proof,
                detail={"proof": proof_id, "steps": steps, "reason": NO_REPLAY_WORKER},
            )
            progress(proof_id)
            settle(proof_id)
    return count
