"""Sliced challenges through the platform (``docs/scale.md``, "The platform's path").

A lab files a sliced run by the SHA-256 of its uploaded run file (``zkdv.sliced.RunFile``:
block layout, parameter order, block programs, every step's commitment), after uploading
the run file and its programs with the upload API. The platform:

1. files it (:func:`file_run`): reads and checks the run file, checks that its programs
   were uploaded by the same organisation, derives the run's seed (HMAC under the
   platform's challenge key of the run file's digest: the same run filed again, in any
   organisation, faces the same slices) and draws ``(step, block, directions)`` for each
   challenge (``zkdv.sliced.draw_challenge``);
2. takes the lab's answer (:func:`answer`): every sequence's projections, after which
   it draws the sequences to open from its *secret* seed and the answer's digest
   (``zkdv.sliced.draw_sequences``), so the lab learns them only once it has committed
   to every projection;
3. takes the opening (:func:`attach_opening`): an uploaded blob, named by its digest;
   the slice is then ``ready`` and queued on the ``replay`` queue;
4. verifies it in a worker (:func:`verify`, the ``replay_slice`` task):
   ``provers.sliced.verify_slice`` with the block's committed program, and records the
   verdict (:func:`record_verdict`); once every slice is final the run is settled
   (:func:`settle`): ``passed`` iff all passed, and the seed is revealed.

Unanswered slices expire at the run's deadline (:func:`expire`), which fails the run.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from celery import current_app
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.errors import ArtifactRejectedError
from attestations.challenges.models import (
    SLICE_FINAL,
    SlicedChallenge,
    SlicedRun,
    SlicedRunStatus,
    SliceStatus,
)
from attestations.challenges.policy import ChallengePolicy
from attestations.challenges.secret import challenge_key
from attestations.core.db import take_claim
from attestations.core.errors import ConflictError, InvalidRequestError
from attestations.experiments.models import Experiment
from attestations.uploads.blobs import mapped
from attestations.uploads.models import Blob, UploadStatus

log = logging.getLogger(__name__)

#: The task that verifies one slice (routed to the ``replay`` queue by its prefix).
VERIFY_TASK = "attestations.tasks.replay_slice"
#: What a sliced run's seed is derived with (HMAC-SHA256 under the challenge key).
SEED_CONTEXT = b"dvbench-sliced-seed-v1\0"
#: Freivalds directions per slice (``q`` of docs/scale.md).
PROJECTIONS = 4
#: The most sequences one step of a sliced run may have: the answer is 8 bytes per
#: sequence and direction, so at most 32 MiB.
MAX_SEQUENCES = 1 << 20
#: The largest run file read into a web worker's memory.
MAX_RUN_FILE_BYTES = 256 * 1024**2


class SlicedRunRejectedError(InvalidRequestError):
    """A run file that cannot be filed as it is (malformed, or naming missing programs)."""

    default_code = "invalid_run_file"


def _owned(experiment: Experiment, digests: Iterable[str]) -> dict[str, Blob]:
    """The blobs named by digest that a completed upload of the experiment's lab stored."""
    return {
        blob.sha256: blob
        for blob in Blob.objects.filter(
            sha256__in=set(digests),
            uploads__status=UploadStatus.COMPLETE,
            uploads__organization_id=experiment.owner_id,
        ).distinct()
    }


def run_seed(digest: str) -> bytes:
    """The seed of a sliced run: the earliest filing's, else HMAC(key, context || digest)."""
    earlier = (
        SlicedRun.objects.filter(digest=digest).order_by("created", "pk").values_list("seed")
    ).first()
    if earlier is not None:
        return bytes.fromhex(earlier[0])
    return hmac.new(challenge_key(), SEED_CONTEXT + bytes.fromhex(digest), hashlib.sha256).digest()


def challenge_count(steps: int, blocks: int, micro_batches: int, rows: int, opened: int) -> int:
    """How many slices a run faces: ``DVBENCH["SLICED_CHALLENGES"]``, else the policy's.

    The policy's count is the number of slices that catch a run with the policy's forged
    fraction of whole-step forgeries with the detection target (299 at 0.95 and 1 %),
    and never more than ``steps x blocks`` (further draws only repeat slices).
    """
    from zkdv.sliced import challenges_needed, detection_probability

    fixed = int(settings.DVBENCH.get("SLICED_CHALLENGES", 0))
    if fixed > 0:
        return fixed
    policy = ChallengePolicy.from_settings()
    if policy.target <= 0.0 or policy.forged_fraction <= 0.0:
        return 0
    per_slice = detection_probability(
        "step",
        forged_fraction=policy.forged_fraction,
        blocks=blocks,
        sequences=micro_batches * rows,
        opened=opened,
    )
    return min(challenges_needed(per_slice, policy.target), steps * blocks)


def file_run(
    experiment: Experiment, sha256: str, *, user: User | None, ip: str | None = None
) -> tuple[SlicedRun, bool]:
    """File the run file uploaded as ``sha256`` and draw its slices; idempotent.

    Returns:
        The run and whether it was filed now (False: the experiment has it already).

    Raises:
        SlicedRunRejectedError: no completed upload of the lab has these bytes, the run
            file is malformed (the error names the field), or a program it names was
            not uploaded. Nothing is stored.
    """
    from zkdv.sliced import RunFile, SlicedFormatError, draw_challenge

    existing = SlicedRun.objects.filter(experiment=experiment, digest=sha256).first()
    if existing is not None:
        return existing, False
    blob = _owned(experiment, [sha256]).get(sha256)
    if blob is None:
        raise SlicedRunRejectedError(
            f"run_file: no completed upload of {experiment.owner.slug} has sha256 {sha256}; "
            "upload the run file first",
            code="blob_not_found",
            field="run_file",
        )
    if blob.size > MAX_RUN_FILE_BYTES:
        raise SlicedRunRejectedError(
            f"run_file: {blob.size} bytes is over the {MAX_RUN_FILE_BYTES} a run file may have",
            field="run_file",
            detail={"size": blob.size, "limit": MAX_RUN_FILE_BYTES},
        )
    try:
        with mapped(blob.storage_name) as data:
            run_file = RunFile.from_bytes(bytes(data))
    except SlicedFormatError as error:
        raise SlicedRunRejectedError(
            f"run_file: {error}", field=f"run_file.{error.field}"
        ) from None
    micro_batches, _, rows = run_file.shape
    if micro_batches * rows > MAX_SEQUENCES:
        raise SlicedRunRejectedError(
            f"run_file.steps[0].shape: {micro_batches * rows} sequences per step is over the "
            f"{MAX_SEQUENCES} a sliced run may have",
            field="run_file.steps[0].shape",
        )
    programs = [*run_file.programs, *([run_file.embed] if run_file.embed else [])]
    owned = _owned(experiment, programs)
    for position, digest in enumerate(programs):
        if digest not in owned:
            where = f"programs[{position}]" if position < len(run_file.programs) else "embed"
            raise SlicedRunRejectedError(
                f"run_file.{where}: no completed upload of {experiment.owner.slug} has the "
                f"program {digest}; upload it first",
                code="blob_not_found",
                field=f"run_file.{where}",
            )
    steps, blocks = len(run_file.steps), run_file.layout.count
    opened = min(int(settings.DVBENCH.get("SLICED_OPENED", 4)), micro_batches * rows)
    count = challenge_count(steps, blocks, micro_batches, rows, opened)
    policy = ChallengePolicy.from_settings()
    now = timezone.now()
    with transaction.atomic():
        # Two filings of one run at once: the experiment's row orders them.
        Experiment.objects.select_for_update().filter(pk=experiment.pk).exists()
        existing = SlicedRun.objects.filter(experiment=experiment, digest=sha256).first()
        if existing is not None:
            return existing, False
        seed = run_seed(sha256)
        run = SlicedRun.objects.create(
            experiment=experiment,
            run_file=blob,
            digest=sha256,
            steps=steps,
            blocks=blocks,
            micro_batches=micro_batches,
            rows=rows,
            seed=seed.hex(),
            seed_commitment=hashlib.sha256(seed).hexdigest(),
            deadline=now + policy.ttl,
            created_by=user,
            created=now,
        )
        rows_: list[SlicedChallenge] = []
        for index in range(count):
            drawn = draw_challenge(
                seed,
                bytes.fromhex(sha256),
                index=index,
                steps=steps,
                blocks=blocks,
                projections=PROJECTIONS,
            )
            rows_.append(
                SlicedChallenge(
                    run=run,
                    index=index,
                    step=drawn.step,
                    block=drawn.block,
                    directions=drawn.seed.hex(),
                    projections=drawn.projections,
                    opened=opened,
                    created=now,
                )
            )
        SlicedChallenge.objects.bulk_create(rows_)
        AuditEvent.record(
            "sliced_run.challenged",
            actor=user,
            organization=experiment.owner,
            target=run,
            detail={
                "experiment": experiment.full_name,
                "digest": sha256,
                "challenges": [[c.step, c.block] for c in rows_],
                "seed_commitment": run.seed_commitment,
                "deadline": run.deadline.isoformat(),
            },
            ip=ip,
        )
        if not rows_:
            settle(run.pk)
    return run, True


def _locked(challenge: SlicedChallenge) -> SlicedChallenge:
    return SlicedChallenge.objects.select_for_update().select_related("run").get(pk=challenge.pk)


def answer(
    challenge: SlicedChallenge, body: bytes, *, user: User | None, ip: str | None = None
) -> SlicedChallenge:
    """Take the lab's projections for one slice and draw the sequences it must open.

    Sending the same bytes again is a no-op; other bytes once answered are a 409.

    Raises:
        InvalidRequestError: a body that is not ``projections x micro_batches x rows``
            finite float64 values (``invalid_answer``; nothing is stored).
        ConflictError: the slice is answered already with other projections, or final.
    """
    from zkdv.sliced import (
        SliceAnswer,
        SliceChallenge,
        SlicedFormatError,
        answer_from_bytes,
        draw_sequences,
    )

    run = challenge.run
    shape = (challenge.projections, run.micro_batches, run.rows)
    try:
        projections = answer_from_bytes(body, shape)
    except SlicedFormatError as error:
        raise InvalidRequestError(
            f"slice {challenge.index}: {error.detail}",
            code="invalid_answer",
            field="body",
            detail={"expected_bytes": 8 * shape[0] * shape[1] * shape[2], "got_bytes": len(body)},
        ) from None
    digest = SliceAnswer(projections).digest()
    with transaction.atomic():
        locked = _locked(challenge)
        if locked.status != SliceStatus.AWAITING_ANSWER:
            if locked.answer_digest == digest.hex():
                return locked
            raise ConflictError(
                f"slice {locked.index} is {locked.status}; its projections were answered "
                "already and cannot change",
                code="slice_answered",
                field="body",
                detail={"status": locked.status},
            )
        drawn = SliceChallenge(
            locked.step, locked.block, bytes.fromhex(locked.directions), locked.projections
        )
        sequences = draw_sequences(
            bytes.fromhex(run.seed),
            drawn,
            digest,
            micro_batches=run.micro_batches,
            rows=run.rows,
            count=locked.opened,
        )
        locked.answer = bytes(body)
        locked.answer_digest = digest.hex()
        locked.sequences = [list(s) for s in sequences]
        locked.status = SliceStatus.AWAITING_OPENING
        locked.answered = timezone.now()
        locked.bytes_moved = len(body)
        locked.save()
        AuditEvent.record(
            "sliced_run.answered",
            actor=user,
            organization=run.experiment.owner,
            target=locked,
            detail={"run": run.pk, "index": locked.index, "sequences": locked.sequences},
            ip=ip,
        )
    return locked


def attach_opening(
    challenge: SlicedChallenge, sha256: str, *, user: User | None, ip: str | None = None
) -> SlicedChallenge:
    """Take the uploaded opening of one answered slice and queue its verification.

    Raises:
        ArtifactRejectedError: no completed upload of the lab has these bytes.
        ConflictError: the slice is not answered yet, or has another opening.
    """
    run = challenge.run
    blob = _owned(run.experiment, [sha256]).get(sha256)
    if blob is None:
        raise ArtifactRejectedError(
            f"opening: no completed upload of {run.experiment.owner.slug} has sha256 {sha256}; "
            "upload the opening first",
            code="blob_not_found",
            field="opening",
        )
    with transaction.atomic():
        locked = _locked(challenge)
        if locked.status == SliceStatus.AWAITING_ANSWER:
            raise ConflictError(
                f"slice {locked.index} has no answer yet: send its projections first, then "
                "open the sequences they draw",
                code="slice_not_answered",
                field="opening",
            )
        if locked.status != SliceStatus.AWAITING_OPENING:
            if locked.opening_id == blob.pk:
                return locked
            raise ConflictError(
                f"slice {locked.index} is {locked.status}; its opening cannot change",
                code="slice_opened",
                field="opening",
                detail={"status": locked.status},
            )
        locked.opening = blob
        locked.status = SliceStatus.READY
        locked.bytes_moved = F("bytes_moved") + blob.size
        locked.save()
        locked.refresh_from_db()
        AuditEvent.record(
            "sliced_run.opened",
            actor=user,
            organization=run.experiment.owner,
            target=locked,
            detail={"run": run.pk, "index": locked.index, "opening": sha256, "size": blob.size},
            ip=ip,
        )
        pk = locked.pk
        transaction.on_commit(lambda: enqueue([pk]))
    return locked


def enqueue(ids: Iterable[int]) -> None:
    """Queue each slice's verification on the ``replay`` queue."""
    for pk in ids:
        result = current_app.signature(VERIFY_TASK, args=(pk,)).apply_async(queue="replay")
        SlicedChallenge.objects.filter(pk=pk).update(task_id=str(result.id))


def claim(pk: int) -> bool:
    """Take a ready slice (or one whose verifying worker died) for this worker."""
    return take_claim(
        SlicedChallenge.objects.filter(pk=pk),
        waiting=SliceStatus.READY,
        working=SliceStatus.VERIFYING,
        attempts=F("attempts") + 1,
    )


#: Loaded programs by SHA-256: a worker loads each block's structure once.
_PROGRAMS: OrderedDict[str, Any] = OrderedDict()
_PROGRAMS_KEPT = 8
_PROGRAMS_LOCK = threading.Lock()


def _program(digest: str) -> Any:
    from zkdv.sliced import load_program

    with _PROGRAMS_LOCK:
        if digest in _PROGRAMS:
            _PROGRAMS.move_to_end(digest)
            return _PROGRAMS[digest]
    blob = Blob.objects.get(sha256=digest)
    with mapped(blob.storage_name) as data:
        module = load_program(bytes(data))
    with _PROGRAMS_LOCK:
        _PROGRAMS[digest] = module
        while len(_PROGRAMS) > _PROGRAMS_KEPT:
            _PROGRAMS.popitem(last=False)
    return module


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
        RunFile,
        SliceAnswer,
        SliceChallenge,
        SlicedFormatError,
        answer_from_bytes,
        opening_from_bytes,
    )

    run = challenge.run
    with mapped(run.run_file.storage_name) as data:
        run_file = RunFile.from_bytes(bytes(data))
    assert challenge.opening is not None
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
    verdict = verify_slice(
        run_file.steps[challenge.step],
        SliceChallenge(
            challenge.step,
            challenge.block,
            bytes.fromhex(challenge.directions),
            challenge.projections,
        ),
        SliceAnswer(answer_from_bytes(bytes(challenge.answer), shape)),
        [tuple(s) for s in challenge.sequences],
        opening,
        names=run_file.names,
        layout=run_file.layout,
        block=block,
        chunk_bytes=run_file.chunk_bytes,
        inputs=run_file.inputs if embed_program is not None else (),
        embed=embed if embed_program is not None else None,
    )
    return {
        "ok": verdict.ok,
        "reason": verdict.reason,
        "message": verdict.message,
        "margins": {k: float(v) for k, v in verdict.margins.items()},
        "seconds": verdict.seconds,
    }


def _failed(reason: str, message: str) -> dict[str, Any]:
    return {"ok": False, "reason": reason, "message": message, "margins": {}, "seconds": 0.0}


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
