"""Resumable, content-addressed multipart uploads through Django's storage API.

The life of an upload:

1. ``create``: the client declares kind, total size and the SHA-256 of the whole blob.
2. ``put_part``: the part's Content-Length is reserved against the declared size (parts
   received plus parts in flight never exceed it), then the body is streamed to a local
   temporary file while it is hashed and counted (a body ending before its
   Content-Length is ``incomplete_body``), checked against the ``X-Part-SHA256`` header,
   then moved under the staging prefix ``staging/uploads/<id>/``. Putting the same part
   again replaces it, so a retried request is harmless (PUT is idempotent).
3. ``complete``: the upload is claimed (``open`` to ``completing``); the parts (which
   must be 1..N with sizes summing to the declared size) are concatenated into a
   temporary file while the whole digest is computed. Only if it matches is the file
   saved under its content address ``blobs/sha256/ab/cd/<hex>``; a blob already stored
   under that address is reused. The upload becomes ``complete`` and the staged parts
   are removed; a refused file makes it ``failed``.
4. ``abort`` (and ``expire_stale`` for uploads left open past their expiry): the upload
   becomes ``aborted`` and the staged parts are removed.

Each transition is made under the upload's row lock and re-checks the state there, so
racing requests get a 200 or a 409 ``upload_not_open``, never a half-done upload: a
``completing`` upload accepts no part, abort or expiry, and an aborted one no part or
completion (see "state transitions" below).

A failed check removes everything staged for the upload, so a partial or mismatching
upload is never visible as a stored artifact and leaves no garbage behind.

What an upload *is* belongs to the app that owns its kind: the proofs app files a
completed transcript as a proof. That app registers its :class:`KindRules` for the kind
(in its ``AppConfig.ready``), and these functions call them at the points below, so this
app imports nothing above it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import DVBenchError, InvalidRequestError, PayloadTooLargeError
from attestations.experiments.models import Experiment
from attestations.uploads.errors import (
    DigestMismatchError,
    IncompleteBodyError,
    MissingPartsError,
    SizeExceededError,
    UploadNotOpenError,
)
from attestations.uploads.models import Blob, PartReservation, Upload, UploadPart, UploadStatus

log = logging.getLogger(__name__)

# Measured on the 2-core CI machine: 256 KiB chunks copy-and-hash at ~430 MB/s, while
# 4 MiB chunks fall to ~140 MB/s (large fresh buffers cost more than the syscalls saved).
CHUNK_BYTES = 256 * 1024
MAX_PARTS = 10_000
PART_DIGEST_HEADER = "X-Part-SHA256"


class KindRules:
    """What the app owning a kind of upload checks and does; every hook may refuse.

    A hook refuses by raising a domain error (``attestations.core.errors``), which the
    upload call raises in turn. The default rules accept everything and do nothing.
    """

    def before_open(self, experiment: Experiment, sha256: str) -> None:
        """Called before an upload of this kind is opened (said before any byte is sent)."""

    def before_complete(self, upload: Upload) -> None:
        """Called when completion starts, before the parts are assembled."""

    def check_file(self, upload: Upload, path: Path) -> None:
        """Called with the assembled file once its digest matched, before it is stored.

        A domain error fails the upload: its parts are removed.
        """

    def completed(self, upload: Upload, *, user: User, ip: str | None) -> None:
        """Called in the completion's transaction, once the blob is stored.

        A domain error rolls the completion back and fails the upload.
        """


_RULES: dict[str, KindRules] = {}
_DEFAULT_RULES = KindRules()


def register_kind(kind: str, rules: KindRules) -> None:
    """Give uploads of ``kind`` their owner's rules (call from ``AppConfig.ready``)."""
    _RULES[kind] = rules


def rules_for(kind: str) -> KindRules:
    return _RULES.get(kind, _DEFAULT_RULES)


def max_blob_bytes() -> int:
    return dvbench_int("MAX_BLOB_BYTES")


def max_part_bytes() -> int:
    return dvbench_int("MAX_PART_BYTES")


def _tmp_dir() -> Path:
    # Beside the media root, so a FileSystemStorage save is a rename, not a copy.
    path = Path(str(settings.DVBENCH["DATA_DIR"])) / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


class _LocalFile(File):  # type: ignore[type-arg]
    """A ``File`` that tells FileSystemStorage it may move the file instead of copying it.

    ``FileSystemStorage._save`` moves anything with ``temporary_file_path()`` into place
    with ``file_move_safe``: one rename, so no reader ever sees a half-written blob.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(open(path, "rb"), name=path.name)  # noqa: SIM115 - closed by File
        self._path = path

    def temporary_file_path(self) -> str:
        return str(self._path)


@contextlib.contextmanager
def _temporary_path(suffix: str) -> Iterator[Path]:
    descriptor, name = tempfile.mkstemp(dir=_tmp_dir(), suffix=suffix)
    os.close(descriptor)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _delete_quietly(name: str) -> None:
    try:
        default_storage.delete(name)
    except OSError:  # pragma: no cover - storage already gone; nothing left to clean
        log.warning("could not delete staged file %s", name, exc_info=True)


# --- create -----------------------------------------------------------------------------


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
    limit = max_blob_bytes()
    if size > limit:
        # A 400, not a 413: the declaration is what is wrong, and it is small.
        raise InvalidRequestError(
            f"size: declared {size} bytes exceeds the limit of {limit} bytes",
            code="blob_too_large",
            field="size",
            detail={"limit": limit, "got": size},
        )
    rules_for(kind).before_open(experiment, sha256)
    ttl = dvbench_int("UPLOAD_TTL_SECONDS")
    upload = Upload.objects.create(
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
        detail={"experiment": experiment.full_name, "kind": kind, "size": size, "sha256": sha256},
        ip=ip,
    )
    return upload


# --- state transitions ------------------------------------------------------------------
#
# Every change of an upload's state (a part registered, completion claimed and recorded,
# abort, expiry) happens in a transaction that holds the upload's row lock
# (``select_for_update``) and reads the state again under it. Requests racing each other
# are thereby serialised: one wins, the other sees what the winner left (a 409, or the
# same answer for a repeated completion or abort), never a half-done state. Staged files
# are deleted only after the transaction that removed the rows naming them committed, so
# a rolled-back change never leaves a row naming a deleted file.

#: A part reservation older than this belongs to a request that died without releasing
#: it (a killed worker). Longer than any request lives (gunicorn's ``timeout`` is 120 s,
#: ``platform/gunicorn.conf.py``).
RESERVATION_SECONDS = 600

_NOT_OPEN = {
    "part": "parts can only be sent to an open upload",
    "complete": "only an open upload can be completed",
    "abort": "only an open upload can be aborted",
}


def _lock(upload: Upload) -> Upload:
    """The upload's row as it is now, locked until the current transaction ends."""
    return Upload.objects.select_for_update().get(pk=upload.pk)


def _require_open(upload: Upload, action: str) -> None:
    if upload.status != UploadStatus.OPEN:
        raise UploadNotOpenError(
            f"upload {upload.id} is {upload.status}; {_NOT_OPEN[action]}",
            field="status",
            detail={"status": upload.status},
        )


def _bytes(queryset: Any) -> int:
    return int(queryset.aggregate(total=Sum("size"))["total"] or 0)


def _drop_parts(locked: Upload) -> list[str]:
    """Delete the rows of the parts and reservations of a locked upload; returns the files."""
    names = list(locked.parts.values_list("storage_name", flat=True))
    locked.parts.all().delete()
    locked.reservations.all().delete()
    return names


def _delete_files(names: list[str]) -> None:
    for name in names:
        _delete_quietly(name)


# --- parts ------------------------------------------------------------------------------


def _size_exceeded(number: int, total: int, declared: int) -> SizeExceededError:
    return SizeExceededError(
        f"part {number}: the parts received and in flight would hold {total} bytes, more "
        f"than the declared size of {declared}",
        code="size_exceeded",
        field="body",
        detail={"expected": declared, "got": total},
    )


def _reserve(upload: Upload, number: int, size: int) -> int:
    """Claim ``size`` bytes of the declared size for part ``number``; returns the claim's id.

    The bytes count against the declared size from before the body is read until the part
    is registered or refused, so parts sent in parallel cannot together stage more than
    was declared. A part already received under ``number`` does not count: sending it
    again replaces it (a retried PUT of a complete set of parts is accepted).
    """
    now = timezone.now()
    with transaction.atomic():
        locked = _lock(upload)
        _require_open(locked, "part")
        locked.reservations.filter(
            created__lt=now - timedelta(seconds=RESERVATION_SECONDS)
        ).delete()
        total = _bytes(locked.parts.exclude(number=number)) + _bytes(locked.reservations) + size
        if total > locked.size:
            raise _size_exceeded(number, total, locked.size)
        return PartReservation.objects.create(upload=locked, number=number, size=size).pk


def _release(reservation: int | None) -> None:
    if reservation is None:
        return
    try:
        PartReservation.objects.filter(pk=reservation).delete()
    except DatabaseError:  # the database is what failed; the claim lapses on its own
        log.warning("could not release part reservation %s", reservation, exc_info=True)


def _stream_to_file(
    stream: IO[bytes], path: Path, limit: int, number: int, expected: int | None
) -> tuple[int, str]:
    """Copy ``stream`` to ``path`` in chunks, hashing as it goes; never more than ``limit``.

    With ``expected`` (the Content-Length) reads no more than that, and raises
    :class:`IncompleteBodyError` when the body ends before it.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as out:
        while True:
            want = CHUNK_BYTES if expected is None else min(CHUNK_BYTES, expected - size)
            chunk = stream.read(want) if want > 0 else b""
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(
                    f"part {number}: body exceeds the part limit of {limit} bytes",
                    code="part_too_large",
                    field="body",
                    detail={"limit": limit},
                )
            digest.update(chunk)
            out.write(chunk)
        if expected is not None and size < expected:
            # The server reads an HTTP body only up to its Content-Length and sees the
            # end early when the client closes its side: what came is not the part.
            raise IncompleteBodyError(f"part {number}", expected, size)
        _sync(out)
    return size, digest.hexdigest()


def _sync(out: IO[bytes]) -> None:
    out.flush()
    # Durable before it is registered: a crash must not leave a row naming lost bytes.
    os.fsync(out.fileno())


def put_part(
    upload: Upload,
    number: int,
    *,
    stream: IO[bytes],
    declared_sha256: str | None,
    content_length: int | None,
) -> UploadPart:
    """Store part ``number`` of ``upload`` from ``stream``; replaces an earlier copy.

    With ``content_length`` (the HTTP API always has it) the bytes are reserved against
    the declared size before the body is read; the part is registered under the upload's
    row lock, where its state and size are checked once more.

    Raises:
        UploadNotOpenError: the upload is completing, complete, aborted or failed (409).
        InvalidRequestError: bad part number or missing/malformed digest header.
        PayloadTooLargeError: the body exceeds ``MAX_PART_BYTES``.
        IncompleteBodyError: the body ended before ``content_length`` bytes (400).
        DigestMismatchError: the body does not hash to the declared digest.
        SizeExceededError: the parts received and in flight would exceed the upload's
            declared size (409).
    """
    # The request's own shape first (number, digest header, length), then the upload's
    # state: a malformed request is a 400 whatever state the upload is in.
    if not 1 <= number <= MAX_PARTS:
        raise InvalidRequestError(
            f"part number must be between 1 and {MAX_PARTS}, got {number}",
            code="invalid_part_number",
            field="number",
            detail={"minimum": 1, "maximum": MAX_PARTS, "got": number},
        )
    declared = (declared_sha256 or "").strip().lower()
    if len(declared) != 64 or any(c not in "0123456789abcdef" for c in declared):
        raise InvalidRequestError(
            f"header {PART_DIGEST_HEADER} must be the part's lowercase hex SHA-256 "
            f"(64 characters), got {declared_sha256!r}",
            code="missing_part_digest" if not declared else "invalid_part_digest",
            field=PART_DIGEST_HEADER,
        )
    if content_length is not None and content_length < 0:
        # Gunicorn refuses it before the application; other servers pass it through.
        raise InvalidRequestError(
            f"Content-Length must be a single whole number of bytes, got {content_length}.",
            code="invalid_header",
            field="Content-Length",
        )
    limit = max_part_bytes()
    if content_length is not None and content_length > limit:
        raise PayloadTooLargeError(
            f"part {number}: Content-Length {content_length} exceeds the part limit of "
            f"{limit} bytes",
            code="part_too_large",
            field="Content-Length",
            detail={"limit": limit, "got": content_length},
        )
    if content_length is None:
        with transaction.atomic():
            _require_open(_lock(upload), "part")
        reservation = None
    else:
        reservation = _reserve(upload, number, content_length)
    try:
        with _temporary_path(".part") as path:
            size, got = _stream_to_file(stream, path, limit, number, content_length)
            if size == 0:
                raise InvalidRequestError(
                    f"part {number} is empty; every part holds at least one byte",
                    code="empty_part",
                    field="body",
                )
            if got != declared:
                raise DigestMismatchError(
                    f"part {number}",
                    declared,
                    got,
                    code="part_digest_mismatch",
                    field=PART_DIGEST_HEADER,
                )
            part, replaced = _register(upload, number, path, size, got, reservation)
    finally:
        _release(reservation)
    if replaced and replaced != part.storage_name:
        _delete_quietly(replaced)
    return part


def _register(
    upload: Upload, number: int, path: Path, size: int, sha256: str, reservation: int | None
) -> tuple[UploadPart, str | None]:
    """Move the verified part into staging and record it, under the upload's row lock.

    Returns the part and the staged file it replaced (to delete once committed). The
    file is moved inside the transaction so that an abort or expiry, which takes the same
    lock, either finds the part's row (and deletes its file) or comes first (and the part
    is refused before its file reaches staging).
    """
    name: str | None = None
    try:
        with transaction.atomic():
            locked = _lock(upload)
            _require_open(locked, "part")
            total = _bytes(locked.parts.exclude(number=number)) + size
            if total > locked.size:
                raise _size_exceeded(number, total, locked.size)
            # A fresh staging name per attempt: a concurrent retry of the same part never
            # overwrites a file another request is about to register.
            name = default_storage.save(
                f"{upload.part_name(number)}.{secrets.token_hex(4)}", _LocalFile(path)
            )
            part = UploadPart.objects.filter(upload=locked, number=number).first()
            replaced: str | None = None
            if part is None:
                part = UploadPart(upload=locked, number=number)
            else:
                replaced = part.storage_name
            part.size, part.sha256, part.storage_name = size, sha256, name
            part.created = timezone.now()
            part.save()
            if reservation is not None:
                # The claim becomes the part's bytes in the same commit.
                PartReservation.objects.filter(pk=reservation).delete()
    except BaseException:
        if name is not None:
            _delete_quietly(name)
        raise
    return part, replaced


# --- complete ---------------------------------------------------------------------------


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
    received = sum(part.size for part in parts)
    if received != upload.size:
        raise MissingPartsError(
            f"size: expected {upload.size} bytes, got {received} bytes in {len(parts)} part(s)",
            code="size_mismatch",
            field="size",
            detail={"expected": upload.size, "got": received},
        )
    return parts


def _close(upload: Upload, status: str, reason: str, *, expected: str) -> bool:
    """Remove every staged part and close the upload as ``status``, if it is ``expected``."""
    with transaction.atomic():
        locked = _lock(upload)
        if locked.status != expected:
            return False
        names = _drop_parts(locked)
        Upload.objects.filter(pk=upload.pk).update(status=status, reason=reason[:64])
    _delete_files(names)
    upload.status, upload.reason = status, reason[:64]
    return True


def _assemble(parts: list[UploadPart], path: Path) -> str:
    """Concatenate the parts into ``path``; returns the SHA-256 of the whole.

    Parts are not re-hashed one by one: a part changed in storage after it was accepted
    changes the whole digest, which is checked against the declaration anyway.
    """
    whole = hashlib.sha256()
    with open(path, "wb") as out:
        for part in parts:
            with default_storage.open(part.storage_name, "rb") as handle:
                while chunk := handle.read(CHUNK_BYTES):
                    whole.update(chunk)
                    out.write(chunk)
        _sync(out)
    return whole.hexdigest()


def _local_path(name: str) -> Path | None:
    """The file behind a storage name, when storage is a local filesystem."""
    try:
        return Path(default_storage.path(name))
    except NotImplementedError:  # remote storage (S3): no paths
        return None


def _adopt_part(part: UploadPart, sha256: str, size: int) -> Blob | None:
    """A one-part upload on local storage: rename the verified part into place.

    The part's digest was computed from its bytes as they arrived, so when it equals
    the declared whole digest the part *is* the blob and no byte needs copying or
    hashing again. Returns None when storage is not local (the caller assembles).
    """
    source = _local_path(part.storage_name)
    if source is None:
        return None
    existing = Blob.objects.filter(sha256=sha256).first()
    if existing is not None and default_storage.exists(existing.storage_name):
        return existing
    address = Blob.address(sha256)
    target = _local_path(address)
    assert target is not None
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)  # atomic: readers see no blob or the whole blob
    blob, created = Blob.objects.get_or_create(
        sha256=sha256, defaults={"size": size, "storage_name": address}
    )
    if not created and blob.storage_name != address:
        Blob.objects.filter(pk=blob.pk).update(storage_name=address)
    return blob


def _store_blob(path: Path, sha256: str, size: int) -> Blob:
    """Save the verified file under its content address, or reuse the blob already there."""
    existing = Blob.objects.filter(sha256=sha256).first()
    if existing is not None and default_storage.exists(existing.storage_name):
        return existing
    address = Blob.address(sha256)
    if default_storage.exists(address):
        # No row claims it: a leftover of a crash between save and insert. Our bytes
        # hash to the same address, so replacing it is safe.
        default_storage.delete(address)
    name = default_storage.save(address, _LocalFile(path))
    try:
        blob, created = Blob.objects.get_or_create(
            sha256=sha256, defaults={"size": size, "storage_name": name}
        )
    except IntegrityError:  # pragma: no cover - lost a race with the same digest
        blob, created = Blob.objects.get(sha256=sha256), False
    if not created:
        if blob.storage_name != name:
            _delete_quietly(name)
        if existing is not None and blob.storage_name != name:
            Blob.objects.filter(pk=blob.pk).update(storage_name=name)
    return blob


def _check_whole_digest(upload: Upload, got: str) -> None:
    if got != upload.sha256:
        raise DigestMismatchError(
            "sha256 of the assembled upload",
            upload.sha256,
            got,
            code="blob_digest_mismatch",
            field="sha256",
        )


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
    rules = rules_for(upload.kind)
    with transaction.atomic():
        locked = _lock(upload)
        if locked.status == UploadStatus.COMPLETE:
            upload.refresh_from_db()
            return upload
        _require_open(locked, "complete")
        parts = _check_parts(locked)
        rules.before_complete(upload)
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.COMPLETING)
    upload.status = UploadStatus.COMPLETING
    try:
        single = _local_path(parts[0].storage_name) if len(parts) == 1 else None
        if single is not None:
            _check_whole_digest(upload, parts[0].sha256)
            rules.check_file(upload, single)
            adopted = _adopt_part(parts[0], upload.sha256, upload.size)
            assert adopted is not None
            blob = adopted
        else:
            with _temporary_path(".blob") as path:
                _check_whole_digest(upload, _assemble(parts, path))
                rules.check_file(upload, path)
                blob = _store_blob(path, upload.sha256, upload.size)
    except DVBenchError as error:  # the bytes are refused (their digest, or their kind's check)
        _fail(upload, error, user=user, ip=ip)
        raise
    except BaseException:
        # Anything unexpected (storage down): the session may be completed again.
        Upload.objects.filter(pk=upload.pk, status=UploadStatus.COMPLETING).update(
            status=UploadStatus.OPEN
        )
        upload.status = UploadStatus.OPEN
        raise
    try:
        names = _record_completion(upload, blob, rules, user=user, ip=ip)
    except DVBenchError as error:
        # Refused by the kind's owner now (another transcript took the experiment's last
        # place since the check above, say): nothing was recorded.
        _fail(upload, error, user=user, ip=ip)
        raise
    _delete_files(names)
    return upload


def _fail(upload: Upload, error: DVBenchError, *, user: User, ip: str | None) -> None:
    if _close(upload, UploadStatus.FAILED, error.error_code, expected=UploadStatus.COMPLETING):
        AuditEvent.record(
            "upload.failed",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            detail={"reason": error.error_code, "message": error.message},
            ip=ip,
        )


def _record_completion(
    upload: Upload, blob: Blob, rules: KindRules, *, user: User, ip: str | None
) -> list[str]:
    """Record the upload complete; returns the staged files to delete once committed."""
    with transaction.atomic():
        locked = _lock(upload)
        if locked.status != UploadStatus.COMPLETING:  # pragma: no cover - nothing else may
            raise UploadNotOpenError(
                f"upload {upload.id} is {locked.status}; it was being completed",
                field="status",
                detail={"status": locked.status},
            )
        names = _drop_parts(locked)
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


# --- abort and expiry -------------------------------------------------------------------


def abort(upload: Upload, *, user: User, ip: str | None = None) -> Upload:
    """Remove the staged parts of an open upload; aborting twice is harmless.

    Raises:
        UploadNotOpenError: the upload is completing, complete or failed (409).
    """
    with transaction.atomic():
        locked = _lock(upload)
        if locked.status == UploadStatus.ABORTED:
            upload.status, upload.reason = locked.status, locked.reason
            return upload
        _require_open(locked, "abort")
        names = _drop_parts(locked)
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.ABORTED, reason="aborted")
        AuditEvent.record(
            "upload.aborted",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            ip=ip,
        )
    _delete_files(names)
    upload.status, upload.reason = UploadStatus.ABORTED, "aborted"
    return upload


def expire_stale(now: Any = None) -> int:
    """Abort open uploads past their expiry; returns how many were removed.

    Each upload is expired under its row lock and only if it is still open and expired
    then; one another request holds (a completion being claimed) is left for the next run.
    """
    cutoff = now or timezone.now()
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
            names = _drop_parts(locked)
            Upload.objects.filter(pk=pk).update(status=UploadStatus.ABORTED, reason="expired")
        _delete_files(names)
        count += 1
    return count
