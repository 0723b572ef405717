"""Verifying sliced challenges, and the verdicts of sliced runs (``docs/scale.md``).

The ``replay_slice`` task (:mod:`attestations.challenges.tasks`) claims a ready slice
(:func:`claim`), verifies it (:func:`verify`: ``provers.sliced.verify_slice`` with the
block's committed program, on an uploaded opening or on the ranges read through the
lab's grant) and records the verdict (:func:`record_verdict`); once every slice is final
the run is settled (:func:`settle`). Unanswered slices expire at the run's deadline
(:func:`expire`). Filing, answers and openings are :mod:`attestations.challenges.sliced`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from attestations.audit.models import AuditEvent
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


@functools.lru_cache(maxsize=8)
def _program(digest: str) -> Any:
    """A committed block program, loaded once per worker (keyed by its SHA-256)."""
    from zkdv.sliced import load_program

    with mapped(Blob.objects.get(sha256=digest).storage_name) as data:
        return load_program(bytes(data))


@functools.lru_cache(maxsize=4)
def _run_file(digest: str) -> Any:
    """A run's file, read and parsed once per worker for all its slices (by its SHA-256)."""
    from zkdv.sliced import RunFile

    with mapped(Blob.objects.get(sha256=digest).storage_name) as data:
        return RunFile.from_bytes(bytes(data))


def verify(challenge: SlicedChallenge) -> dict[str, Any]:
    """Verify one claimed slice from its stored run file, answer and opening.

    Returns:
        ``{ok, reason, message, margins, seconds}``: ``provers.sliced.verify_slice``'s
        verdict, or a failure the lab caused before it could run (``opening_format``:
        an opening that is not one; ``program``: a block program that does not load).
    """
    import torch
    from torch.func import functional_call

    from provers.sliced import verify_slice
    from zkdv.sliced import (
        SliceAnswer,
        SliceChallenge,
        SlicedFormatError,
        answer_from_bytes,
        opening_from_bytes,
    )

    run = challenge.run
    run_file = _run_file(run.digest)
    opening = None
    if challenge.opening is not None:
        try:
            with mapped(challenge.opening.storage_name) as data:
                opening = opening_from_bytes(bytes(data))
        except SlicedFormatError as error:
            return _failed("opening_format", f"the opening is malformed: {error}")
    try:
        block = _program(run_file.programs[challenge.block])
        embed_program = _program(run_file.embed) if run_file.embed else None
    except Exception as error:  # noqa: BLE001 - the lab's bytes: torch.export.load raises anything
        return _failed("program", f"a committed program does not load: {error}")

    def embed(tables: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        assert embed_program is not None
        weights = {name: t.to(torch.float64) for name, t in tables.items()}
        embedded: torch.Tensor = functional_call(embed_program, weights, (tokens,))
        return embedded

    shape = (challenge.projections, run.micro_batches, run.rows)
    assert challenge.answer is not None
    common: dict[str, Any] = {
        "names": run_file.names,
        "layout": run_file.layout,
        "block": block,
        "chunk_bytes": run_file.chunk_bytes,
        "inputs": run_file.inputs if embed_program is not None else (),
        "embed": embed if embed_program is not None else None,
    }
    arguments = (
        run_file.steps[challenge.step],
        SliceChallenge(
            challenge.step,
            challenge.block,
            bytes.fromhex(challenge.directions),
            challenge.projections,
        ),
        SliceAnswer(answer_from_bytes(bytes(challenge.answer), shape)),
        [tuple(s) for s in challenge.sequences],
    )
    moved = 0
    if opening is not None:
        verdict = verify_slice(*arguments, opening, **common)
    else:
        verdict, moved = _verify_from_store(run, challenge, arguments, common)
    return {
        "ok": verdict.ok,
        "reason": verdict.reason,
        "message": verdict.message,
        # JSON has no infinity: a measure off every scale is null.
        "margins": {
            k: (float(v) if math.isfinite(v) else None) for k, v in verdict.margins.items()
        },
        "seconds": verdict.seconds,
        "moved": moved,
    }


def _verify_from_store(
    run: SlicedRun,
    challenge: SlicedChallenge,
    arguments: tuple[Any, ...],
    common: dict[str, Any],
) -> tuple[Any, int]:
    """Read the opened ranges through the lab's grant and verify them; and bytes read."""
    from provers.sliced import SliceVerdict
    from provers.sliced_store import RangeReader, verify_slice_from_store
    from zkdv.sliced_store import Grant, GrantError

    try:
        # The grant was checked when it was given; it may have expired since.
        reader = RangeReader(
            Grant.from_dict(challenge.grant or {}),
            run=bytes.fromhex(run.digest),
            budget=int(settings.DVBENCH["MAX_BLOB_BYTES"]),
        )
    except (GrantError, ValueError) as error:
        return SliceVerdict(ok=True).fail("store", str(error)), 0
    verdict = verify_slice_from_store(reader, *arguments, **common)
    return verdict, reader.transfer.bytes


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
