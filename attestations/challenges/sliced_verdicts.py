"""Verifying sliced challenges, and the verdicts of sliced runs (``docs/scale.md``).

The ``replay_slice`` task (:mod:`attestations.challenges.tasks`) claims a ready slice
(:func:`claim`), verifies it (:func:`verify`: ``provers.sliced.verify_slice`` with the
block's committed program, in a sandboxed child process, on an uploaded opening or on
the ranges read through the lab's grant) and records the verdict (:func:`record_verdict`); once every slice is final
the run is settled (:func:`settle`). Unanswered slices expire at the run's deadline
(:func:`expire`). Filing, answers and openings are :mod:`attestations.challenges.sliced`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges import sandboxed
from attestations.challenges.models import (
    SLICE_FINAL,
    SlicedChallenge,
    SlicedRun,
    SlicedRunStatus,
    SliceStatus,
)
from attestations.core.db import take_claim
from attestations.uploads.blobs import mapped
from attestations.uploads.models import Blob

log = logging.getLogger(__name__)


def claim(pk: int) -> bool:
    """Take a ready slice (or one whose verifying worker died) for this worker."""
    return take_claim(
        SlicedChallenge.objects.filter(pk=pk),
        waiting=SliceStatus.READY,
        working=SliceStatus.VERIFYING,
        attempts=F("attempts") + 1,
    )


def _blob_bytes(digest: str) -> bytes:
    with mapped(Blob.objects.get(sha256=digest).storage_name) as data:
        return bytes(data)


def verify(challenge: SlicedChallenge) -> dict[str, Any]:
    """Verify one claimed slice from its stored run file, answer and opening.

    The check runs the block's committed program, so it runs in a sandboxed child
    process (:func:`attestations.challenges.sandboxed.verify_slice`), never here. An
    opening read through the lab's grant is fetched here first (the platform's own
    HTTP reads, which the sandbox, having no network, cannot make).

    Returns:
        ``{ok, reason, message, margins, seconds, moved}``: ``provers.sliced.verify_slice``'s
        verdict, or a failure the lab caused before it could run (``opening_format``:
        an opening that is not one; ``program_unsafe``: a block program the platform
        refuses to load, :mod:`zkdv.untrusted`; ``program``: one that does not load;
        ``store``: a grant the worker could not read through).
    """
    from zkdv.sliced import RunFile

    run = challenge.run
    run_bytes = _blob_bytes(run.digest)
    run_file: RunFile = RunFile.from_bytes(run_bytes)
    moved = 0
    if challenge.opening is not None:
        with mapped(challenge.opening.storage_name) as data:
            opening = bytes(data)
    else:
        fetched, moved = _fetch_from_store(run, challenge, run_file)
        if isinstance(fetched, dict):
            return fetched
        opening = fetched
    inputs: dict[str, Any] = {
        "run_file": run_bytes,
        "block.pt2": _blob_bytes(run_file.programs[challenge.block]),
        "opening": opening,
        "answer": bytes(challenge.answer or b""),
    }
    if run_file.embed:
        inputs["embed.pt2"] = _blob_bytes(run_file.embed)
    arguments = {
        "run_file": "run_file",
        "block": "block.pt2",
        "embed": "embed.pt2" if run_file.embed else None,
        "opening": "opening",
        "answer": "answer",
        "step": challenge.step,
        "block_index": challenge.block,
        "directions": challenge.directions,
        "projections": challenge.projections,
        "micro_batches": run.micro_batches,
        "rows": run.rows,
        "sequences": [list(s) for s in challenge.sequences],
    }
    verdict = sandboxed.verify_slice(arguments, inputs)
    return {
        "ok": bool(verdict["ok"]),
        "reason": str(verdict["reason"]),
        "message": str(verdict["message"]),
        "margins": dict(verdict["margins"]),
        "seconds": float(verdict["seconds"]),
        # What the platform itself moved, not what the child says.
        "moved": moved,
    }


def _fetch_from_store(
    run: SlicedRun, challenge: SlicedChallenge, run_file: Any
) -> tuple[bytes | dict[str, Any], int]:
    """Read the opened ranges through the lab's grant: the opening's bytes (or a
    ``store`` failure), and the bytes read."""
    from provers.sliced_store import RangeReader, StoreError, fetch_slice
    from zkdv.sliced import SliceChallenge, opening_to_bytes
    from zkdv.sliced_store import Grant, GrantError

    try:
        # The grant was checked when it was given; it may have expired since.
        reader = RangeReader(
            Grant.from_dict(challenge.grant or {}),
            run=bytes.fromhex(run.digest),
            budget=int(settings.DVBENCH["MAX_BLOB_BYTES"]),
        )
    except (GrantError, ValueError) as error:
        return _failed("store", str(error)), 0
    try:
        fetched = fetch_slice(
            reader,
            run_file.steps[challenge.step],
            SliceChallenge(
                challenge.step,
                challenge.block,
                bytes.fromhex(challenge.directions),
                challenge.projections,
            ),
            [(int(m), int(r)) for m, r in challenge.sequences],
            names=run_file.names,
            layout=run_file.layout,
            inputs=run_file.inputs if run_file.embed else (),
        )
    except StoreError as error:
        return _failed("store", str(error)), reader.transfer.bytes
    return opening_to_bytes(fetched.opening), reader.transfer.bytes


def _failed(reason: str, message: str) -> dict[str, Any]:
    return {
        "ok": False,
        "reason": reason,
        "message": message,
        "margins": {},
        "seconds": 0.0,
        "moved": 0,
    }


def record_verdict(pk: int, verdict: dict[str, Any]) -> bool:
    """Store a slice's verdict and settle its run; False if it was no longer ours."""
    ok = bool(verdict["ok"])
    with transaction.atomic():
        done = SlicedChallenge.objects.filter(pk=pk, status=SliceStatus.VERIFYING).update(
            status=SliceStatus.PASSED if ok else SliceStatus.FAILED,
            reason="" if ok else str(verdict["reason"])[:64],
            message="" if ok else str(verdict["message"]),
            margins=verdict["margins"],
            seconds=verdict["seconds"],
            bytes_moved=F("bytes_moved") + int(verdict.get("moved") or 0),
            finished=timezone.now(),
        )
        if not done:
            return False
        challenge = SlicedChallenge.objects.select_related("run__experiment__owner").get(pk=pk)
        AuditEvent.record(
            f"sliced_run.slice_{'passed' if ok else 'failed'}",
            organization=challenge.run.experiment.owner,
            target=challenge,
            detail={
                "run": challenge.run_id,
                "index": challenge.index,
                "step": challenge.step,
                "block": challenge.block,
                "reason": None if ok else verdict["reason"],
            },
        )
        settle(challenge.run_id)
    return True


def record_error(pk: int, reason: str, message: str) -> None:
    """A permanent failure that is not the lab's fault (the verification itself broke)."""
    with transaction.atomic():
        done = SlicedChallenge.objects.filter(
            pk=pk, status__in=[SliceStatus.VERIFYING, SliceStatus.READY]
        ).update(
            status=SliceStatus.ERROR, reason=reason[:64], message=message, finished=timezone.now()
        )
        if done:
            settle(SlicedChallenge.objects.values_list("run_id", flat=True).get(pk=pk))


def release_claim(pk: int) -> None:
    """Give a claimed slice back (a transient failure: the retry claims it again)."""
    SlicedChallenge.objects.filter(pk=pk, status=SliceStatus.VERIFYING).update(
        status=SliceStatus.READY
    )


def settle(run_id: int) -> str | None:
    """Give the run its verdict once every slice is final; None while some are not.

    ``passed`` iff every slice passed; otherwise ``failed`` with the first failing
    slice's reason. Locks the run's row, so two workers finishing the last two slices
    settle it once. The seed is revealed with the verdict.
    """
    run = SlicedRun.objects.select_for_update().select_related("experiment__owner").get(pk=run_id)
    if run.status != SlicedRunStatus.CHALLENGED:
        return None
    slices = list(run.challenges.order_by("index"))
    if any(s.status not in SLICE_FINAL for s in slices):
        return None
    failed = next((s for s in slices if s.status != SliceStatus.PASSED), None)
    run.settled = timezone.now()
    if failed is None:
        run.status, run.reason, run.message = SlicedRunStatus.PASSED, "", ""
    else:
        run.status = SlicedRunStatus.FAILED
        run.reason = failed.reason or failed.status
        run.message = (
            f"slice {failed.index} (step {failed.step}, block {failed.block}): "
            f"{failed.message or failed.get_status_display()}"
        )
    run.save(update_fields=["status", "reason", "message", "settled"])
    AuditEvent.record(
        f"sliced_run.{run.status}",
        organization=run.experiment.owner,
        target=run,
        detail={"digest": run.digest, "reason": run.reason or None, "slices": len(slices)},
    )
    return str(run.status)


def expire(now: Any = None) -> int:
    """Expire the unanswered or unopened slices of runs past their deadline."""
    now = now or timezone.now()
    count = 0
    overdue = SlicedRun.objects.filter(status=SlicedRunStatus.CHALLENGED, deadline__lt=now)
    for run_id in overdue.values_list("pk", flat=True):
        with transaction.atomic():
            expired = SlicedChallenge.objects.filter(
                run_id=run_id,
                status__in=[SliceStatus.AWAITING_ANSWER, SliceStatus.AWAITING_OPENING],
            ).update(
                status=SliceStatus.EXPIRED,
                reason="challenge_expired",
                message="the slice was not answered and opened before the deadline",
                finished=now,
            )
            if expired:
                settle(run_id)
        count += expired
    return count
