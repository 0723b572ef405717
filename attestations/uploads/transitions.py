"""An upload's changes of state, each made under its row lock.

Every change of an upload's state (a part registered, completion claimed and recorded,
abort, expiry) happens in a transaction that holds the upload's row lock
(``select_for_update``) and reads the state again under it. Requests racing each other
are thereby serialised: one wins, the other sees what the winner left (a 409, or the
same answer for a repeated completion or abort), never a half-done state. Staged files
are deleted only after the transaction that removed the rows naming them committed, so
a rolled-back change never leaves a row naming a deleted file.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import DVBenchError
from attestations.uploads import blobs, disk, s3
from attestations.uploads.errors import UploadNotOpenError
from attestations.uploads.kinds import KindRules
from attestations.uploads.models import Blob, Upload, UploadStatus

log = logging.getLogger(__name__)


_NOT_OPEN = {
    "part": "parts can only be sent to an open upload",
    "complete": "only an open upload can be completed",
    "abort": "only an open upload can be aborted",
}


def lock(upload: Upload) -> Upload:
    """The upload's row as it is now, locked until the current transaction ends."""
    return Upload.objects.select_for_update().get(pk=upload.pk)


def require_open(upload: Upload, action: str) -> None:
    if upload.status != UploadStatus.OPEN:
        raise UploadNotOpenError(
            f"upload {upload.id} is {upload.status}; {_NOT_OPEN[action]}",
            field="status",
            detail={"status": upload.status},
        )


def drop_parts(locked: Upload) -> list[str]:
    """Delete the rows of the parts and reservations of a locked upload; returns the files."""
    # A direct upload's parts are declarations (no staged file): S3 holds its bytes.
    names = {n for n in locked.parts.values_list("storage_name", flat=True) if n}
    if not locked.direct:
        names.add(disk.data_name(locked))  # written by a refused part, if by none stored
    locked.parts.all().delete()
    locked.reservations.all().delete()
    return sorted(names)


def delete_files(names: list[str]) -> None:
    for name in names:
        blobs.delete_quietly(name)


def discard_direct(upload: Upload) -> None:
    """Abort a closed direct upload's S3 multipart upload and delete its staging object.

    After the transaction that closed it committed: no part URL is issued any more, and
    S3 drops the parts it holds (a part PUT racing the abort may leave one, which S3's
    lifecycle rule for incomplete multipart uploads removes; docs/operators.md).
    """
    if not upload.direct:
        return
    try:
        s3.discard(upload.staging_object, upload.s3_upload_id)
    except Exception:  # pragma: no cover - S3 down: its lifecycle rule cleans up
        log.warning("could not discard the S3 upload of %s", upload.id, exc_info=True)


def close(upload: Upload, status: str, reason: str, *, expected: str) -> bool:
    """Remove every staged part and close the upload as ``status``, if it is ``expected``."""
    with transaction.atomic():
        locked = lock(upload)
        if locked.status != expected:
            return False
        names = drop_parts(locked)
        Upload.objects.filter(pk=upload.pk).update(status=status, reason=reason[:64])
    delete_files(names)
    discard_direct(locked)
    upload.status, upload.reason = status, reason[:64]
    return True


def reopen(upload: Upload) -> None:
    """Back to open after a completion that stopped short; resumable for the TTL again."""
    expires = timezone.now() + timedelta(seconds=dvbench_int("UPLOAD_TTL_SECONDS"))
    Upload.objects.filter(pk=upload.pk, status=UploadStatus.COMPLETING).update(
        status=UploadStatus.OPEN, expires=expires
    )
    upload.status, upload.expires = UploadStatus.OPEN, expires


def fail(upload: Upload, error: DVBenchError, *, user: User, ip: str | None) -> None:
    if close(upload, UploadStatus.FAILED, error.error_code, expected=UploadStatus.COMPLETING):
        AuditEvent.record(
            "upload.failed",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            detail={"reason": error.error_code, "message": error.message},
            ip=ip,
        )


def record_completion(
    upload: Upload, blob: Blob, rules: KindRules, *, user: User, ip: str | None
) -> list[str]:
    """Record the upload complete; returns the staged files to delete once committed."""
    with transaction.atomic():
        locked = lock(upload)
        if locked.status != UploadStatus.COMPLETING:
            # The claim outlived its lease and expire_stale reopened it (the blob is
            # stored: completing again reuses it).
            raise UploadNotOpenError(
                f"upload {upload.id} is {locked.status}; its completion outlived its lease "
                "and was reopened: complete it again",
                field="status",
                detail={"status": locked.status},
            )
        names = drop_parts(locked)
        upload.status, upload.blob, upload.completed = UploadStatus.COMPLETE, blob, timezone.now()
        upload.save(update_fields=["status", "blob", "completed"])
        AuditEvent.record(
            "upload.completed",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            detail={
                "experiment": upload.experiment.full_name,
                "kind": upload.kind,
                "sha256": blob.sha256,
                "size": blob.size,
            },
            ip=ip,
        )
        rules.completed(upload, user=user, ip=ip)
    return names
