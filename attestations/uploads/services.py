"""Resumable, content-addressed multipart uploads through Django's storage API.

The life of an upload, and the module that does each step:

1. ``create`` (here): the client declares kind, total size and the SHA-256 of the whole
   blob.
2. :func:`attestations.uploads.parts.put_part`: the part's Content-Length is reserved
   against the declared size (parts received plus parts in flight never exceed it), then
   the body is streamed to a local temporary file while it is hashed and counted (a body
   ending before its Content-Length is ``incomplete_body``), checked against the
   ``X-Part-SHA256`` header, then moved under the staging prefix
   ``staging/uploads/<id>/``; on local disk a part sent in order is written in place into
   the upload's data file instead (:mod:`attestations.uploads.disk`). Putting the same
   part again replaces it, so a retried request is harmless (PUT is idempotent). With S3
   storage the parts go straight to object storage instead
   (:mod:`attestations.uploads.direct`).
3. ``complete`` (here): the upload is claimed (``open`` to ``completing``); the parts
   (which must be 1..N with sizes summing to the declared size) are concatenated into a
   temporary file and the whole digest is finished. A part sent after its predecessor
   was hashed into the whole as it was written (``uploads.sha256state`` saves the
   digest's state with the part), so completion hashes only parts that came out of
   order: in-order uploads hash each byte once. When the parts lie end to end in the
   data file, it is renamed into place: nothing is copied. Only if it matches is the file
   saved under its content address ``blobs/sha256/ab/cd/<hex>``
   (:mod:`attestations.uploads.blobs`); a blob already stored under that address is
   reused. The upload becomes ``complete`` and the staged parts are removed; a refused
   file makes it ``failed``.
4. ``abort`` (and ``expire_stale`` for uploads left open past their expiry), here: the
   upload becomes ``aborted`` and the staged parts are removed.

Each transition is made under the upload's row lock and re-checks the state there
(:mod:`attestations.uploads.transitions`), so racing requests get a 200 or a 409
``upload_not_open``, never a half-done upload: a ``completing`` upload accepts no part,
abort or expiry, and an aborted one no part or completion.

A failed check removes everything staged for the upload, so a partial or mismatching
upload is never visible as a stored artifact and leaves no garbage behind.

What an upload *is* belongs to the app that owns its kind: the proofs app files a
completed transcript as a proof. That app registers its
:class:`~attestations.uploads.kinds.KindRules` for the kind (in its ``AppConfig.ready``),
and these functions call them, so this app imports nothing above it.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import (
    ConflictError,
    DVBenchError,
    InvalidRequestError,
)
from attestations.experiments.models import Experiment
from attestations.uploads import blobs, direct, disk, kinds, limits, s3, transitions
from attestations.uploads.errors import MissingPartsError
from attestations.uploads.models import Upload, UploadPart, UploadStatus

log = logging.getLogger(__name__)


def create(
    *,
    experiment: Experiment,
    kind: str,
    size: int,
    sha256: str,
    user: User,
    ip: str | None = None,
    name: str = "",
) -> Upload:
    """Open an upload session for ``experiment`` (validated by the serializer).

    ``name`` is the file's path in the client's proof directory: informational (the
    proof's artifact list is what names files for replay), kept to make sessions legible.
    """
    limit = limits.max_blob_bytes()
    if size > limit:
        # A 400, not a 413: the declaration is what is wrong, and it is small.
        raise InvalidRequestError(
            f"size: declared {size} bytes exceeds the limit of {limit} bytes",
            code="blob_too_large",
            field="size",
            detail={"limit": limit, "got": size},
        )
    kinds.rules_for(kind).before_open(experiment, sha256)
    ttl = dvbench_int("UPLOAD_TTL_SECONDS")
    pk = uuid.uuid4()
    s3_upload_id = ""
    if s3.enabled():
        # Direct: the parts go to an S3 multipart upload of the staging object.
        s3_upload_id = s3.create_multipart(Upload(id=pk).staging_object)
    upload = Upload.objects.create(
        id=pk,
        s3_upload_id=s3_upload_id,
        organization=experiment.owner,
        experiment=experiment,
        kind=kind,
        name=name[:255],
        size=size,
        sha256=sha256,
        created_by=user,
        expires=timezone.now() + timedelta(seconds=ttl),
    )
    AuditEvent.record(
        "upload.created",
        actor=user,
        organization=experiment.owner,
        target=upload,
        detail={
            "experiment": experiment.full_name,
            "kind": kind,
            "size": size,
            "sha256": sha256,
            "direct": bool(s3_upload_id),
        },
        ip=ip,
    )
    return upload


def _check_parts(upload: Upload) -> list[UploadPart]:
    parts = list(upload.parts.order_by("number"))
    numbers = [part.number for part in parts]
    expected = list(range(1, len(parts) + 1))
    if not parts or numbers != expected:
        highest = numbers[-1] if numbers else 0
        missing = sorted(set(range(1, highest + 1)) - set(numbers)) or [highest + 1]
        raise MissingPartsError(
            f"parts must be numbered 1..N without gaps; missing part(s) {missing[:20]}",
            field="parts",
            detail={"missing": missing[:100], "received": numbers[:100]},
        )
    small = [p.number for p in parts[:-1] if p.size < s3.MIN_PART_BYTES] if upload.direct else []
    if small:
        raise ConflictError(
            f"part(s) {small[:20]} are smaller than {s3.MIN_PART_BYTES} bytes, object "
            "storage's least size of any part but the last: declare them again larger",
            code="part_too_small",
            field="parts",
            detail={"parts": small[:100], "minimum": s3.MIN_PART_BYTES},
        )
    received = sum(part.size for part in parts)
    if received != upload.size:
        raise MissingPartsError(
            f"size: expected {upload.size} bytes, got {received} bytes in {len(parts)} part(s)",
            code="size_mismatch",
            field="size",
            detail={"expected": upload.size, "got": received},
        )
    return parts


def complete(upload: Upload, *, user: User, ip: str | None = None) -> Upload:
    """Verify and store the blob, then hand it to its kind's rules (a transcript is filed).

    Completion is claimed under the upload's row lock (``open`` to ``completing``), with
    the parts read under the same lock; while it is ``completing`` parts, aborts, expiry
    and other completions are refused, so the parts being assembled stay there. Completing
    an already completed upload returns it unchanged (a retried request).

    Raises:
        MissingPartsError: parts missing or of the wrong total size (409 ``missing_parts``
            or ``size_mismatch``); the upload stays open so the client can send what is
            missing.
        DigestMismatchError: the assembled bytes do not hash to the declared digest; the
            upload fails and its parts are removed.
        UploadNotOpenError: the upload is being completed by another request, or was
            aborted, expired or failed (409).
        DVBenchError: the kind's rules refused it (a transcript naming another experiment
            or spec is ``TranscriptRejectedError``, past the experiment's proofs
            ``TooManyProofsError``); a refusal of the file fails the upload.
    """
    rules = kinds.rules_for(upload.kind)
    with transaction.atomic():
        locked = transitions.lock(upload)
        if locked.status == UploadStatus.COMPLETE:
            upload.refresh_from_db()
            return upload
        transitions.require_open(locked, "complete")
        parts = _check_parts(locked)
        rules.before_complete(upload)
        lease = timezone.now() + completion_lease(upload.size)
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.COMPLETING, expires=lease)
    upload.status, upload.expires = UploadStatus.COMPLETING, lease
    if upload.direct:
        return direct.complete(upload, parts, rules, user=user, ip=ip)
    try:
        data = disk.in_place(upload, parts)
        single = disk.local_path(parts[0].storage_name) if len(parts) == 1 else None
        if data is not None:
            # The parts lie end to end in the data file: it is the blob.
            whole = blobs.Whole(parts)
            pieces = disk.segments(parts) or []
            disk.hash_segments(pieces[whole.chained :], whole)
            blobs.check_whole_digest(upload, whole.hexdigest())
            disk.settle(data, upload.size)
            rules.check_file(upload, data)
            blob = blobs.adopt(data, upload.sha256, upload.size)
        elif single is not None:
            blobs.check_whole_digest(upload, parts[0].sha256)
            rules.check_file(upload, single)
            blob = blobs.adopt(single, upload.sha256, upload.size)
        else:
            with blobs.temporary_path(".blob") as path:
                blobs.check_whole_digest(upload, blobs.assemble(parts, path))
                rules.check_file(upload, path)
                blob = blobs.store(path, upload.sha256, upload.size)
    except DVBenchError as error:  # the bytes are refused (their digest, or their kind's check)
        transitions.fail(upload, error, user=user, ip=ip)
        raise
    except BaseException:
        # Anything unexpected (storage down): the session may be completed again.
        transitions.reopen(upload)
        raise
    try:
        names = transitions.record_completion(upload, blob, rules, user=user, ip=ip)
    except DVBenchError as error:
        # Refused by the kind's owner now (another transcript took the experiment's last
        # place since the check above, say): nothing was recorded.
        transitions.fail(upload, error, user=user, ip=ip)
        raise
    transitions.delete_files(names)
    return upload


def abort(upload: Upload, *, user: User, ip: str | None = None) -> Upload:
    """Remove the staged parts of an open upload; aborting twice is harmless.

    Raises:
        UploadNotOpenError: the upload is completing, complete or failed (409).
    """
    with transaction.atomic():
        locked = transitions.lock(upload)
        if locked.status == UploadStatus.ABORTED:
            upload.status, upload.reason = locked.status, locked.reason
            return upload
        transitions.require_open(locked, "abort")
        names = transitions.drop_parts(locked)
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.ABORTED, reason="aborted")
        AuditEvent.record(
            "upload.aborted",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            ip=ip,
        )
    transitions.delete_files(names)
    transitions.discard_direct(locked)
    upload.status, upload.reason = UploadStatus.ABORTED, "aborted"
    return upload


#: A completion claim's lease: the time to hash and join the parts at a slow disk's pace
#: (32 MiB/s), plus ten minutes. A claim whose worker died is reopened after it.
LEASE_SECONDS, LEASE_BYTES_PER_SECOND = 600, 32 << 20


def completion_lease(size: int) -> timedelta:
    """How long a completion of ``size`` bytes may hold its claim (``completing``)."""
    return timedelta(seconds=LEASE_SECONDS + size // LEASE_BYTES_PER_SECOND)


def expire_stale(now: Any = None) -> int:
    """Abort open uploads past their expiry; returns how many were removed.

    Each upload is expired under its row lock and only if it is still open and expired
    then; one another request holds (a completion being claimed) is left for the next run.
    A completion claim past its lease (:func:`completion_lease`: the worker died or was
    killed mid-completion) is reopened first, so the client's retry completes it.
    """
    cutoff = now or timezone.now()
    for pk in Upload.objects.filter(status=UploadStatus.COMPLETING, expires__lt=cutoff).values_list(
        "pk", flat=True
    ):
        with transaction.atomic():
            stuck = (
                Upload.objects.select_for_update(skip_locked=True)
                .filter(pk=pk, status=UploadStatus.COMPLETING, expires__lt=cutoff)
                .first()
            )
            if stuck is None:
                continue
            transitions.reopen(stuck)
            AuditEvent.record(
                "upload.reopened",
                organization=stuck.experiment.owner,
                target=stuck,
                detail={"reason": "completion_lease_expired"},
            )
            log.warning("upload %s: completion claim past its lease, reopened", pk)
    stale = Upload.objects.filter(status=UploadStatus.OPEN, expires__lt=cutoff)
    count = 0
    for pk in list(stale.values_list("pk", flat=True)):
        with transaction.atomic():
            locked = (
                Upload.objects.select_for_update(skip_locked=True)
                .filter(pk=pk, status=UploadStatus.OPEN, expires__lt=cutoff)
                .first()
            )
            if locked is None:
                continue
            names = transitions.drop_parts(locked)
            Upload.objects.filter(pk=pk).update(status=UploadStatus.ABORTED, reason="expired")
        transitions.delete_files(names)
        transitions.discard_direct(locked)
        count += 1
    return count
