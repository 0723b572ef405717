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
4. verifies it in a worker (the ``replay_slice`` task,
   :mod:`~attestations.challenges.sliced_verdicts`): ``provers.sliced.verify_slice`` with
   the block's committed program; once every slice is final the run is settled,
   ``passed`` iff all passed. Unanswered slices expire at the run's deadline, which
   fails the run.

Filing the same run file again (in any experiment) never buys a fresh draw, and a
revealed seed never helps a later filing (issue 59): a later filing faces the first
filing's slices exactly (:func:`file_run`), and each slice's first answer, in whichever
filing it came, is pinned: a later answer to that slice must be the same bytes
(:func:`answer`, 409 ``answer_differs``), so it draws the same sequences. Without the
pin, a seed revealed with one filing's verdict let the next filing try answers a few
ulps apart offline until the draw avoided its lie (they still pass the projection
check's tolerance). So the seed is shown only once it can help nobody:
:func:`seed_is_spent`, the run settled and every slice of its run file pinned.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from celery import current_app
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.answers import owned_blobs
from attestations.challenges.errors import ArtifactRejectedError
from attestations.challenges.models import (
    SlicedChallenge,
    SlicedRun,
    SlicedRunStatus,
    SliceStatus,
)
from attestations.challenges.policy import ChallengePolicy
from attestations.challenges.secret import challenge_key
from attestations.challenges.sliced_verdicts import settle
from attestations.core.errors import ConflictError, InvalidRequestError
from attestations.experiments.models import Experiment
from attestations.uploads.blobs import mapped
from attestations.uploads.models import Blob

if TYPE_CHECKING:
    from zkdv.sliced import RunFile

log = logging.getLogger(__name__)

#: The task that verifies one slice (routed to the ``replay`` queue by its prefix).
VERIFY_TASK = "attestations.challenges.tasks.replay_slice"
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
    existing = SlicedRun.objects.filter(experiment=experiment, digest=sha256).first()
    if existing is not None:
        return existing, False
    blob, run_file = _read_run_file(experiment, sha256)
    micro_batches, _, rows = run_file.shape
    steps, blocks = len(run_file.steps), run_file.layout.count
    opened = min(int(settings.DVBENCH.get("SLICED_OPENED", 4)), micro_batches * rows)
    count = challenge_count(steps, blocks, micro_batches, rows, opened)
    now = timezone.now()
    with transaction.atomic():
        # Two filings of one run at once: the experiment's row orders them.
        Experiment.objects.select_for_update().filter(pk=experiment.pk).exists()
        existing = SlicedRun.objects.filter(experiment=experiment, digest=sha256).first()
        if existing is not None:
            return existing, False
        seed = run_seed(sha256)
        first = SlicedRun.objects.filter(digest=sha256).order_by("created", "pk").first()
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
            deadline=now + ChallengePolicy.from_settings().ttl,
            created_by=user,
            created=now,
        )
        # A later filing faces the first filing's slices, whatever the policy says now:
        # the same count and the same opened sequences per slice, so that every answer
        # pinned by an earlier filing applies to it.
        slices = (
            _draw(run, seed, count=count, opened=opened) if first is None else _refile(first, run)
        )
        AuditEvent.record(
            "sliced_run.challenged",
            actor=user,
            organization=experiment.owner,
            target=run,
            detail={
                "experiment": experiment.full_name,
                "digest": sha256,
                "challenges": [[c.step, c.block] for c in slices],
                "seed_commitment": run.seed_commitment,
                "deadline": run.deadline.isoformat(),
            },
            ip=ip,
        )
        if not slices:
            settle(run.pk)
    return run, True


def _read_run_file(experiment: Experiment, sha256: str) -> tuple[Blob, RunFile]:
    """The uploaded run file, read and checked, with every program it names uploaded."""
    from zkdv.sliced import RunFile, SlicedFormatError

    blob = owned_blobs(experiment.owner_id, [sha256]).get(sha256)
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
        # A limit refused from the CBOR headers (zkdv.sliced._bounded) says which and what
        # it found, so the lab can tell a format error from a run too large to file.
        limits = {"limit": error.limit, "got": error.got} if error.limit is not None else None
        raise SlicedRunRejectedError(
            f"run_file: {error}", field=f"run_file.{error.field}", detail=limits
        ) from None
    micro_batches, _, rows = run_file.shape
    if micro_batches * rows > MAX_SEQUENCES:
        raise SlicedRunRejectedError(
            f"run_file.steps[0].shape: {micro_batches * rows} sequences per step is over the "
            f"{MAX_SEQUENCES} a sliced run may have",
            field="run_file.steps[0].shape",
        )
    programs = [*run_file.programs, *([run_file.embed] if run_file.embed else [])]
    owned = owned_blobs(experiment.owner_id, programs)
    for position, digest in enumerate(programs):
        if digest not in owned:
            where = f"programs[{position}]" if position < len(run_file.programs) else "embed"
            raise SlicedRunRejectedError(
                f"run_file.{where}: no completed upload of {experiment.owner.slug} has the "
                f"program {digest}; upload it first",
                code="blob_not_found",
                field=f"run_file.{where}",
            )
    return blob, run_file


def _draw(run: SlicedRun, seed: bytes, *, count: int, opened: int) -> list[SlicedChallenge]:
    """Draw and store the run's slices: each a uniform step and block, and directions."""
    from zkdv.sliced import draw_challenge

    slices = []
    for index in range(count):
        drawn = draw_challenge(
            seed,
            bytes.fromhex(run.digest),
            index=index,
            steps=run.steps,
            blocks=run.blocks,
            projections=PROJECTIONS,
        )
        slices.append(
            SlicedChallenge(
                run=run,
                index=index,
                step=drawn.step,
                block=drawn.block,
                directions=drawn.seed.hex(),
                projections=drawn.projections,
                opened=opened,
                created=run.created,
            )
        )
    return SlicedChallenge.objects.bulk_create(slices)


def _refile(first: SlicedRun, run: SlicedRun) -> list[SlicedChallenge]:
    """The first filing's slices, copied to a later filing of the same run file."""
    return SlicedChallenge.objects.bulk_create(
        SlicedChallenge(
            run=run,
            index=c.index,
            step=c.step,
            block=c.block,
            directions=c.directions,
            projections=c.projections,
            opened=c.opened,
            created=run.created,
        )
        for c in first.challenges.order_by("index")
    )


def pinned_answer(digest: str, index: int) -> str | None:
    """The digest of the first answer to slice ``index`` of run file ``digest``, in any filing.

    Answers never change once given, so the first is the one every filing must give.
    """
    return (
        SlicedChallenge.objects.filter(run__digest=digest, index=index)
        .exclude(answer_digest="")
        .order_by("answered", "pk")
        .values_list("answer_digest", flat=True)
        .first()
    )


def answered_indexes(digests: Iterable[str]) -> dict[str, set[int]]:
    """For each run file digest, the indexes of its slices answered in some filing (one query)."""
    answered: dict[str, set[int]] = {digest: set() for digest in digests}
    rows = (
        SlicedChallenge.objects.filter(run__digest__in=list(answered))
        .exclude(answer_digest="")
        .values_list("run__digest", "index")
        .distinct()
    )
    for digest, index in rows:
        answered[digest].add(index)
    return answered


def seed_is_spent(run: SlicedRun, answered: dict[str, set[int]] | None = None) -> bool:
    """Whether showing ``run``'s seed can no longer help any filing of its run file.

    The seed draws a slice's sequences from the digest of its answer. While a slice of
    the run file has no answer in any filing, a later filing could try answers against
    a known seed offline; once every slice is answered somewhere, every filing must give
    those answers (:func:`answer`) and the draws are fixed. The run must be settled too.
    ``answered`` is :func:`answered_indexes` of a page of runs, read once for all.
    """
    if run.status == SlicedRunStatus.CHALLENGED:
        return False
    if answered is None or run.digest not in answered:
        answered = answered_indexes([run.digest])
    return all(c.index in answered[run.digest] for c in run.challenges.all())


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
        _check_pinned(run, locked, digest.hex())
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


def _check_pinned(run: SlicedRun, challenge: SlicedChallenge, digest: str) -> None:
    """409 ``answer_differs`` unless this is the slice's first answer or the same bytes.

    The first filing's row is locked first, so two filings answering one slice at once
    pin one answer, not two.
    """
    SlicedRun.objects.select_for_update().filter(digest=run.digest).order_by("created", "pk").only(
        "pk"
    ).first()
    pinned = pinned_answer(run.digest, challenge.index)
    if pinned is not None and pinned != digest:
        # Neither the earlier filing nor its answer is named: it may be another lab's.
        raise ConflictError(
            f"slice {challenge.index}: this run file's slice {challenge.index} was answered "
            "in an earlier filing, and every filing of a run file must send that answer "
            "byte for byte (its opened sequences stand); these projections differ",
            code="answer_differs",
            field="body",
            detail={"index": challenge.index},
        )


def attach_opening(
    challenge: SlicedChallenge,
    sha256: str | None = None,
    *,
    grant: dict[str, Any] | None = None,
    user: User | None,
    ip: str | None = None,
) -> SlicedChallenge:
    """Take the opening of one answered slice and queue its verification.

    The opening is either an uploaded blob (``sha256``) or a read grant on the lab's
    own bucket (``grant``, ``zkdv.sliced_store.Grant``'s dict), from which the worker
    reads only the opened ranges. A grant is checked before it is stored: its endpoint
    must be one of ``DVBENCH["SLICED_STORE_ENDPOINTS"]``, it must name this run, be
    unexpired, and hold a URL under its prefix for every object of the challenged step.

    Raises:
        ArtifactRejectedError: no completed upload of the lab has these bytes.
        InvalidRequestError: a grant that cannot be used (``invalid_grant``), or one at an
            endpoint the platform does not read from (``store_not_allowed``).
        ConflictError: the slice is not answered yet, or has another opening.
    """
    run = challenge.run
    blob = None
    if grant is not None:
        grant = _checked_grant(run, challenge, grant)
    else:
        blob = _uploaded_opening(run, str(sha256))
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
            if (blob is not None and locked.opening_id == blob.pk) or (
                grant is not None and locked.grant == grant
            ):
                return locked
            raise ConflictError(
                f"slice {locked.index} is {locked.status}; its opening cannot change",
                code="slice_opened",
                field="opening",
                detail={"status": locked.status},
            )
        locked.opening = blob
        locked.grant = grant
        locked.status = SliceStatus.READY
        if blob is not None:
            locked.bytes_moved = F("bytes_moved") + blob.size
        locked.save()
        locked.refresh_from_db()
        # A grant's URLs carry the lab's signatures: the trail names the grant, not them.
        shown = (
            {"opening": sha256, "size": blob.size}
            if blob is not None
            else {"grant": {k: v for k, v in (grant or {}).items() if k != "urls"}}
        )
        AuditEvent.record(
            "sliced_run.opened",
            actor=user,
            organization=run.experiment.owner,
            target=locked,
            detail={"run": run.pk, "index": locked.index, **shown},
            ip=ip,
        )
        pk = locked.pk
        transaction.on_commit(lambda: enqueue([pk]))
    return locked


def _uploaded_opening(run: SlicedRun, sha256: str) -> Blob:
    blob = owned_blobs(run.experiment.owner_id, [sha256]).get(sha256)
    if blob is None:
        raise ArtifactRejectedError(
            f"opening: no completed upload of {run.experiment.owner.slug} has sha256 "
            f"{sha256}; upload the opening first",
            code="blob_not_found",
            field="opening",
        )
    return blob


def _checked_grant(
    run: SlicedRun, challenge: SlicedChallenge, data: dict[str, Any]
) -> dict[str, Any]:
    """The grant as stored, once it is one the worker may use for this slice."""
    from zkdv.sliced_store import Grant, GrantError, object_names

    try:
        grant = Grant.from_dict(data)
    except ValueError as error:
        raise InvalidRequestError(f"grant: {error}", code="invalid_grant", field="grant") from None
    allowed = settings.DVBENCH.get("SLICED_STORE_ENDPOINTS") or []
    if grant.endpoint.rstrip("/") not in allowed:
        raise InvalidRequestError(
            f"grant.endpoint: the platform does not read from {grant.endpoint!r}; the stores "
            "it reads are the operator's DVBENCH_SLICED_STORE_ENDPOINTS"
            + (f" ({', '.join(allowed)})" if allowed else " (none)"),
            code="store_not_allowed",
            field="grant.endpoint",
        )
    try:
        grant.check(bytes.fromhex(run.digest))
    except GrantError as error:
        raise InvalidRequestError(f"grant: {error}", code="invalid_grant", field="grant") from None
    missing = [n for n in object_names(challenge.step).values() if n not in grant.urls]
    if missing:
        raise InvalidRequestError(
            f"grant.urls: step {challenge.step}'s objects {', '.join(missing)} are not granted",
            code="invalid_grant",
            field="grant.urls",
        )
    return grant.to_dict()


def enqueue(ids: Iterable[int]) -> None:
    """Queue each slice's verification on the ``replay`` queue."""
    for pk in ids:
        result = current_app.signature(VERIFY_TASK, args=(pk,)).apply_async(queue="replay")
        SlicedChallenge.objects.filter(pk=pk).update(task_id=str(result.id))
