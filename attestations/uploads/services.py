"""Resumable, content-addressed multipart uploads through Django's storage API.

The life of an upload:

1. ``create``: the client declares kind, total size and the SHA-256 of the whole blob.
2. ``put_part``: the part's Content-Length is reserved against the declared size (parts
   received plus parts in flight never exceed it), then the body is streamed to a local
   temporary file while it is hashed and counted (a body ending before its
   Content-Length is ``incomplete_body``), checked against the ``X-Part-SHA256`` header,
   then moved under the staging prefix ``staging/uploads/<id>/``; on local disk a part
   sent in order is written in place into the upload's data file instead
   (:mod:`attestations.uploads.disk`). Putting the same part again replaces it, so a
   retried request is harmless (PUT is idempotent).
3. ``complete``: the upload is claimed (``open`` to ``completing``); the parts (which
   must be 1..N with sizes summing to the declared size) are concatenated into a
   temporary file and the whole digest is finished. A part sent after its predecessor
   was hashed into the whole as it was written (``uploads.sha256state`` saves the
   digest's state with the part), so completion hashes only parts that came out of
   order: in-order uploads hash each byte once. When the parts lie end to end in the
   data file, it is renamed into place: nothing is copied. Only if it matches is the file
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
import mmap
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
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
from attestations.core.errors import (
    ConflictError,
    DVBenchError,
    InvalidRequestError,
    PayloadTooLargeError,
)
from attestations.experiments.models import Experiment
from attestations.uploads import disk, s3, sha256state
from attestations.uploads.errors import (
    DigestMismatchError,
    IncompleteBodyError,
    MissingPartsError,
    SizeExceededError,
    UploadNotOpenError,
)
from attestations.uploads.models import Blob, PartReservation, Upload, UploadPart, UploadStatus

log = logging.getLogger(__name__)

# Measured on the 2-core CI machine (bench/bench_api.py): gunicorn reads a body in steps
# of at most 1 MiB, and reading it in 1 MiB chunks costs the web worker ~7 s of CPU per
# GiB received against ~9 s in 256 KiB chunks; 4 MiB chunks were slower again (large
# fresh buffers cost more than the calls they save).
CHUNK_BYTES = 1024 * 1024
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
    # A direct upload's parts are declarations (no staged file): S3 holds its bytes.
    names = {n for n in locked.parts.values_list("storage_name", flat=True) if n}
    if not locked.direct:
        names.add(disk.data_name(locked))  # written by a refused part, if by none stored
    locked.parts.all().delete()
    locked.reservations.all().delete()
    return sorted(names)


def _delete_files(names: list[str]) -> None:
    for name in names:
        _delete_quietly(name)


def _discard_direct(upload: Upload) -> None:
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
    was declared. A part already received or in flight under ``number`` does not count:
    sending it again replaces it (a retried PUT of a complete set of parts is accepted).
    """
    now = timezone.now()
    with transaction.atomic():
        locked = _lock(upload)
        _require_open(locked, "part")
        locked.reservations.filter(
            created__lt=now - timedelta(seconds=RESERVATION_SECONDS)
        ).delete()
        # Claims of the same number are left out, as its received part is: copies of one
        # part replace each other, and a retry must not be refused for the claim of the
        # attempt it retries (cut off mid-body, its request not yet ended).
        others = locked.reservations.exclude(number=number)
        total = _bytes(locked.parts.exclude(number=number)) + _bytes(others) + size
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
    stream: IO[bytes],
    target: Path | disk.Slot,
    limit: int,
    number: int,
    expected: int | None,
    chain: sha256state.ResumableSHA256 | None = None,
) -> tuple[int, str]:
    """Copy ``stream`` to ``target`` in chunks, hashing as it goes; never more than ``limit``.

    ``target`` is a file of the part's own, or its slot in the upload's data file.

    With ``expected`` (the Content-Length) reads no more than that, and raises
    :class:`IncompleteBodyError` when the body ends before it. With ``chain`` (the whole
    file's digest so far) each chunk is hashed into it too, in a second thread while this
    one hashes the part's own digest and writes: both hashes release the GIL, so the
    part costs one hash's time, not two.
    """
    digest = hashlib.sha256()
    size = 0
    with contextlib.ExitStack() as stack:
        out: Any = (
            target if isinstance(target, disk.Slot) else stack.enter_context(open(target, "wb"))
        )
        pool = None
        if chain is not None:
            pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="dvbench-chain"))
        chained: Any = None
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
            if pool is not None and chain is not None:
                if chained is not None:
                    chained.result()
                chained = pool.submit(chain.update, chunk)
            digest.update(chunk)
            out.write(chunk)
        if chained is not None:
            chained.result()
        if expected is not None and size < expected:
            # The server reads an HTTP body only up to its Content-Length and sees the
            # end early when the client closes its side: what came is not the part.
            raise IncompleteBodyError(f"part {number}", expected, size)
        if isinstance(out, disk.Slot):
            out.sync()
        else:
            _sync(out)
    return size, digest.hexdigest()


def _sync(out: IO[bytes]) -> None:
    out.flush()
    # Durable before it is registered: a crash must not leave a row naming lost bytes.
    os.fsync(out.fileno())


def _check_part_request(
    upload: Upload, number: int, declared_sha256: str | None, content_length: int | None
) -> tuple[str, int]:
    """The part request's own shape (number, digest header, length), before the upload's
    state: a malformed request is a 400 whatever state the upload is in. Returns the
    declared digest, normalised, and the part limit."""
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
    if upload.direct:
        raise ConflictError(
            f"upload {upload.id} takes its parts straight to object storage: ask for part "
            f"{number}'s URL with POST /api/v1/uploads/{upload.id}/parts/{number}/url/",
            code="direct_upload",
            field="number",
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
    return declared, limit


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
    declared, limit = _check_part_request(upload, number, declared_sha256, content_length)
    if content_length is None:
        with transaction.atomic():
            _require_open(_lock(upload), "part")
        reservation = None
    else:
        reservation = _reserve(upload, number, content_length)
    base = _chain_base(upload, number)
    chain = None if base is None else sha256state.ResumableSHA256(base)
    slot = None
    try:
        with contextlib.ExitStack() as stack:
            # In order: written in place into the upload's data file (its range locked
            # until the part is registered); else a file of its own (``uploads.disk``).
            slot = disk.claim(upload, number, content_length)
            if slot is not None:
                stack.enter_context(slot)
            target = slot or stack.enter_context(_temporary_path(".part"))
            if slot is not None:
                stack.callback(_abandon_unless_stored, slot, upload, number)
            size, got = _stream_to_file(stream, target, limit, number, content_length, chain)
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
            after = None if chain is None else chain.state()
            part, replaced = _register(
                upload, number, target, size, got, reservation, chain=(base, after)
            )
    except UploadNotOpenError:
        if slot is not None:
            _discard_if_closed(upload)
        raise
    finally:
        _release(reservation)
    if replaced and replaced not in (part.storage_name, disk.data_name(upload)):
        _delete_quietly(replaced)
    return part


def _abandon_unless_stored(slot: disk.Slot, upload: Upload, number: int) -> None:
    """A refused in-place part leaves nothing behind (runs before its slot is unlocked)."""
    stored = UploadPart.objects.filter(
        upload=upload, number=number, storage_name=slot.name, offset=slot.offset
    ).exists()
    if not stored:
        slot.abandon()


def _discard_if_closed(upload: Upload) -> None:
    """Remove a data file a refused in-place part wrote after its upload was closed.

    Abort, expiry, failure and completion remove (or rename) the data file; a request
    that was already writing may have created it again. Nothing reads it then.
    """
    status = Upload.objects.filter(pk=upload.pk).values_list("status", flat=True).first()
    if status in (UploadStatus.ABORTED, UploadStatus.FAILED, UploadStatus.COMPLETE):
        disk.discard(upload)


def _chain_base(upload: Upload, number: int) -> bytes | None:
    """The whole file's SHA-256 state before part ``number``, if the part before it holds
    one (parts sent in order; a part that overtakes its predecessor starts no chain)."""
    if not sha256state.available():
        return None
    if number == 1:
        return sha256state.initial_state()
    before = (
        UploadPart.objects.filter(upload=upload, number=number - 1)
        .values_list("chain", flat=True)
        .first()
    )
    return None if before is None else bytes(before)


def _register(
    upload: Upload,
    number: int,
    target: Path | disk.Slot,
    size: int,
    sha256: str,
    reservation: int | None,
    *,
    chain: tuple[bytes | None, bytes | None] = (None, None),
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
            if isinstance(target, disk.Slot):
                offset: int | None = target.offset
                name = target.name
            else:
                offset = None
                # A fresh staging name per attempt: a concurrent retry of the same part
                # never overwrites a file another request is about to register.
                name = default_storage.save(
                    f"{upload.part_name(number)}.{secrets.token_hex(4)}", _LocalFile(target)
                )
            part = UploadPart.objects.filter(upload=locked, number=number).first()
            replaced: str | None = None
            if part is None:
                part = UploadPart(upload=locked, number=number)
            else:
                replaced = part.storage_name
            part.size, part.sha256, part.storage_name = size, sha256, name
            part.chain_base, part.chain = chain
            part.offset = offset
            part.created = timezone.now()
            part.save()
            if reservation is not None:
                # The claim becomes the part's bytes in the same commit.
                PartReservation.objects.filter(pk=reservation).delete()
    except BaseException:
        if name is not None and not isinstance(target, disk.Slot):
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


def _close(upload: Upload, status: str, reason: str, *, expected: str) -> bool:
    """Remove every staged part and close the upload as ``status``, if it is ``expected``."""
    with transaction.atomic():
        locked = _lock(upload)
        if locked.status != expected:
            return False
        names = _drop_parts(locked)
        Upload.objects.filter(pk=upload.pk).update(status=status, reason=reason[:64])
    _delete_files(names)
    _discard_direct(locked)
    upload.status, upload.reason = status, reason[:64]
    return True


class _Whole:
    """The whole file's digest, taken up where the parts' chain of states ends."""

    def __init__(self, parts: list[UploadPart]) -> None:
        state, self.chained = sha256state.initial_state(), 0
        if sha256state.available():
            for part in parts:
                base, after = part.chain_base, part.chain
                # A part replaced after its successor was hashed on from it leaves that
                # successor's base unequal to the replacement's state: the chain ends.
                if base is None or after is None or bytes(base) != state:
                    break
                state, self.chained = bytes(after), self.chained + 1
        self.digest: Any = sha256state.ResumableSHA256(state) if self.chained else hashlib.sha256()

    def __call__(self, data: bytes | memoryview) -> None:
        self.digest.update(data)

    def hexdigest(self) -> str:
        return str(self.digest.hexdigest())


def _assemble(parts: list[UploadPart], path: Path) -> str:
    """Concatenate the parts into ``path``; returns the SHA-256 of the whole.

    Parts sent in order were hashed into the whole as they were written (their chain of
    states), so only the parts after the chain's end are read and hashed here: in-order
    uploads cost one hash per byte. The bytes were hashed as they arrived and made
    durable before their part was recorded; the copy that joins them is checked by size.
    """
    whole = _Whole(parts)
    pieces = disk.segments(parts)
    if pieces is not None:
        disk.assemble(pieces, path, pieces[whole.chained :], whole)
        return whole.hexdigest()
    with open(path, "wb") as out:
        for index, part in enumerate(parts):
            with default_storage.open(part.storage_name, "rb") as handle:
                while chunk := handle.read(CHUNK_BYTES):
                    if index >= whole.chained:
                        whole(chunk)
                    out.write(chunk)
        _sync(out)
    return whole.hexdigest()


@contextlib.contextmanager
def mapped(name: str) -> Iterator[bytes | mmap.mmap]:
    """A stored file's bytes, mapped read-only rather than read into memory.

    Local storage maps the file where it lies; remote storage (S3) streams it once into
    a temporary file, which is mapped. Either way a checked snapshot of many gigabytes
    costs page cache, not the worker's memory.
    """
    with contextlib.ExitStack() as stack:
        path = disk.local_path(name)
        if path is None:
            path = stack.enter_context(_temporary_path(".blob"))
            with default_storage.open(name, "rb") as source, open(path, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                region = None
            else:
                region = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if region is None:
            yield b""
            return
        try:
            yield region
        finally:
            with contextlib.suppress(BufferError):  # arrays still view it: freed with them
                region.close()


def _adopt(source: Path, sha256: str, size: int) -> Blob:
    """Rename a verified local file that holds the whole blob into its content address.

    A one-part upload's part, or the data file of an upload whose parts lie in it end to
    end: their digest was computed from the bytes as they arrived, so when it equals the
    declared whole digest the file *is* the blob and no byte needs copying or hashing
    again.
    """
    existing = Blob.objects.filter(sha256=sha256).first()
    if existing is not None and default_storage.exists(existing.storage_name):
        return existing
    address = Blob.address(sha256)
    target = disk.local_path(address)
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
        lease = timezone.now() + completion_lease(upload.size)
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.COMPLETING, expires=lease)
    upload.status, upload.expires = UploadStatus.COMPLETING, lease
    if upload.direct:
        return _complete_direct(upload, parts, rules, user=user, ip=ip)
    try:
        data = disk.in_place(upload, parts)
        single = disk.local_path(parts[0].storage_name) if len(parts) == 1 else None
        if data is not None:
            # The parts lie end to end in the data file: it is the blob.
            whole = _Whole(parts)
            pieces = disk.segments(parts) or []
            disk.hash_segments(pieces[whole.chained :], whole)
            _check_whole_digest(upload, whole.hexdigest())
            disk.settle(data, upload.size)
            rules.check_file(upload, data)
            blob = _adopt(data, upload.sha256, upload.size)
        elif single is not None:
            _check_whole_digest(upload, parts[0].sha256)
            rules.check_file(upload, single)
            blob = _adopt(single, upload.sha256, upload.size)
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
        _reopen(upload)
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
        if locked.status != UploadStatus.COMPLETING:
            # The claim outlived its lease and expire_stale reopened it (the blob is
            # stored: completing again reuses it).
            raise UploadNotOpenError(
                f"upload {upload.id} is {locked.status}; its completion outlived its lease "
                "and was reopened: complete it again",
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


# --- direct uploads (S3) ----------------------------------------------------------------
#
# With S3 storage the client PUTs each part to a presigned URL (``uploads/s3.py``); the
# platform records each part's declared size and SHA-256 as an ``UploadPart`` without a
# staged file, and at completion checks what S3 holds against the declarations, reading
# S3's answers only: no byte of a snapshot passes through the web worker.

#: How far S3's clock and ours may disagree when a part's upload time is checked against
#: the expiry of the URL it was declared with.
CLOCK_SKEW_SECONDS = 60


@dataclass(frozen=True)
class PartURL:
    """Where and how to PUT one declared part of a direct upload."""

    part: UploadPart
    url: str
    headers: dict[str, str]
    expires: datetime


def _check_number(number: int) -> None:
    if not 1 <= number <= MAX_PARTS:
        raise InvalidRequestError(
            f"part number must be between 1 and {MAX_PARTS}, got {number}",
            code="invalid_part_number",
            field="number",
            detail={"minimum": 1, "maximum": MAX_PARTS, "got": number},
        )


def declare_part(upload: Upload, number: int, *, size: int, sha256: str) -> PartURL:
    """Record part ``number`` of a direct upload as declared; returns its presigned URL.

    Declaring a part again (a retry, or a URL that expired) replaces the declaration.
    The declared sizes of all parts never exceed the upload's size.

    Raises:
        InvalidRequestError: bad part number, size or digest (400).
        PayloadTooLargeError: ``size`` exceeds ``MAX_PART_BYTES`` (413 ``part_too_large``).
        ConflictError: the upload's parts go through the API (409 ``not_direct``).
        UploadNotOpenError: the upload is not open (409).
        SizeExceededError: the declared parts would exceed the upload's size (409).
    """
    _check_number(number)
    declared = (sha256 or "").strip().lower()
    if len(declared) != 64 or any(c not in "0123456789abcdef" for c in declared):
        raise InvalidRequestError(
            f"sha256 must be the part's lowercase hex SHA-256 (64 characters), got {sha256!r}",
            code="invalid_part_digest",
            field="sha256",
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidRequestError(
            f"size must be a whole number of bytes, at least 1, got {size!r}",
            code="invalid",
            field="size",
        )
    if not upload.direct:
        raise ConflictError(
            f"upload {upload.id} takes its parts through the API: PUT "
            f"/api/v1/uploads/{upload.id}/parts/{number}/",
            code="not_direct",
            field="number",
        )
    limit = max_part_bytes()
    if size > limit:
        raise PayloadTooLargeError(
            f"part {number}: size {size} exceeds the part limit of {limit} bytes",
            code="part_too_large",
            field="size",
            detail={"limit": limit, "got": size},
        )
    lifetime = dvbench_int("S3_PRESIGN_SECONDS")
    with transaction.atomic():
        locked = _lock(upload)
        _require_open(locked, "part")
        total = _bytes(locked.parts.exclude(number=number)) + size
        if total > locked.size:
            error = _size_exceeded(number, total, locked.size)
            error.field = "size"
            raise error
        now = timezone.now()
        part, _ = UploadPart.objects.update_or_create(
            upload=locked,
            number=number,
            defaults={"size": size, "sha256": declared, "storage_name": "", "created": now},
        )
    url, headers = s3.presign_part(
        upload.staging_object, upload.s3_upload_id, number, size, declared, lifetime
    )
    return PartURL(part, url, headers, now + timedelta(seconds=lifetime))


def direct_parts(upload: Upload) -> list[dict[str, Any]]:
    """The declared parts of an open direct upload that S3 holds, as declared (to resume).

    A part S3 holds with another size, or another SHA-256 where S3 reports one, is left
    out: the client sends it again. Where S3 reports no per-part SHA-256 (moto), a part
    of the declared size is listed and completion's composite checksum checks its bytes.
    """
    if upload.status != UploadStatus.OPEN or not upload.direct:
        return [
            {"number": p.number, "size": p.size, "sha256": p.sha256} for p in upload.parts.all()
        ]
    try:
        stored = s3.list_parts(upload.staging_object, upload.s3_upload_id)
    except s3.S3Error:
        return []
    found = []
    for part in upload.parts.order_by("number"):
        got = stored.get(part.number)
        if got is None or got.size != part.size or got.sha256 not in (None, part.sha256):
            continue
        found.append({"number": part.number, "size": part.size, "sha256": part.sha256})
    return found


class _ReopenError(Exception):
    """A completion refused before S3 assembled anything: the upload stays open."""

    def __init__(self, error: DVBenchError) -> None:
        super().__init__(error.message)
        self.error = error


def _check_stored_parts(upload: Upload, parts: list[UploadPart]) -> dict[int, s3.StoredPart]:
    """What S3 holds, checked against the declarations; raises what is wrong.

    Missing parts and parts sent after their URL expired reopen the upload (send them
    again); a part of another size or SHA-256 than declared fails it.
    """
    stored = s3.list_parts(upload.staging_object, upload.s3_upload_id)
    missing = [p.number for p in parts if p.number not in stored]
    if missing:
        raise _ReopenError(
            MissingPartsError(
                f"object storage holds no part(s) {missing[:20]} of upload {upload.id}: "
                "PUT them to their URLs, then complete again",
                field="parts",
                detail={"missing": missing[:100], "received": sorted(stored)[:100]},
            )
        )
    lifetime = timedelta(seconds=dvbench_int("S3_PRESIGN_SECONDS") + CLOCK_SKEW_SECONDS)
    late = [p.number for p in parts if stored[p.number].modified > p.created + lifetime]
    if late:
        raise _ReopenError(
            ConflictError(
                f"part(s) {late[:20]} reached object storage after their URL expired: ask "
                "for new URLs and send them again",
                code="part_url_expired",
                field="parts",
                detail={"parts": late[:100]},
            )
        )
    for part in parts:
        got = stored[part.number]
        if got.size > part.size:
            raise SizeExceededError(
                f"part {part.number}: object storage holds {got.size} bytes, more than the "
                f"{part.size} declared for it",
                code="size_exceeded",
                field="parts",
                detail={"part": part.number, "expected": part.size, "got": got.size},
            )
        if got.size < part.size:
            raise IncompleteBodyError(f"part {part.number}", part.size, got.size)
        if got.sha256 is not None and got.sha256 != part.sha256:
            raise DigestMismatchError(
                f"part {part.number}",
                part.sha256,
                got.sha256,
                code="part_digest_mismatch",
                field="parts",
            )
    return stored


def _assemble_direct(upload: Upload, parts: list[UploadPart]) -> None:
    """Have S3 assemble the parts, then check the size and the composite checksum."""
    name = upload.staging_object
    try:
        stored = _check_stored_parts(upload, parts)
    except s3.S3Error as error:
        if error.code != "NoSuchUpload":
            raise
        # A completion that died after S3 assembled the parts: the object is there.
        stored = {}
    if stored:
        try:
            s3.complete_multipart(
                name,
                upload.s3_upload_id,
                [(p.number, stored[p.number].etag, p.sha256) for p in parts],
            )
        except s3.S3Error as error:
            if error.code in ("InvalidPart", "BadDigest", "InvalidDigest"):
                raise DigestMismatchError(
                    "parts (object storage refused their SHA-256s)",
                    upload.sha256,
                    error.code,
                    code="part_digest_mismatch",
                    field="parts",
                ) from None
            raise
    size, checksum = s3.head(name)
    if size != upload.size:
        raise MissingPartsError(
            f"size: expected {upload.size} bytes, object storage assembled {size}",
            code="size_mismatch",
            field="size",
            detail={"expected": upload.size, "got": size},
        )
    expected = s3.composite([p.sha256 for p in parts])
    if checksum is not None and checksum not in (expected, upload.sha256):
        # S3's checksum of the parts' SHA-256s, from the bytes it holds: a part whose
        # bytes are not the ones declared (S3 that does not check x-amz-checksum-sha256).
        raise DigestMismatchError(
            "SHA-256 of the parts' SHA-256s (object storage's composite checksum)",
            expected,
            checksum,
            code="part_digest_mismatch",
            field="parts",
        )


def _store_direct_blob(name: str, sha256: str, size: int) -> Blob:
    """Copy the verified staging object to its content address, or reuse the blob there."""
    existing = Blob.objects.filter(sha256=sha256).first()
    if existing is not None and default_storage.exists(existing.storage_name):
        return existing
    address = Blob.address(sha256)
    # From this upload's own object, whose digest was just checked: a concurrent upload of
    # the same digest writes the same bytes.
    s3.copy(name, address)
    try:
        blob, created = Blob.objects.get_or_create(
            sha256=sha256, defaults={"size": size, "storage_name": address}
        )
    except IntegrityError:  # pragma: no cover - lost a race with the same digest
        blob, created = Blob.objects.get(sha256=sha256), False
    if not created and blob.storage_name != address:
        Blob.objects.filter(pk=blob.pk).update(storage_name=address)
    return blob


def _verify_direct(upload: Upload, parts: list[UploadPart], rules: KindRules) -> Blob:
    _assemble_direct(upload, parts)
    name = upload.staging_object
    _check_whole_digest(upload, s3.whole_sha256(name, upload.size))
    if type(rules).check_file is not KindRules.check_file:
        # The kind's owner reads the file (a transcript's root record): it is fetched
        # once. Snapshots, batches and artifacts are never read here.
        with _temporary_path(".blob") as path:
            s3.download(name, path)
            rules.check_file(upload, path)
    return _store_direct_blob(name, upload.sha256, upload.size)


def _reopen(upload: Upload) -> None:
    """Back to open after a completion that stopped short; resumable for the TTL again."""
    expires = timezone.now() + timedelta(seconds=dvbench_int("UPLOAD_TTL_SECONDS"))
    Upload.objects.filter(pk=upload.pk, status=UploadStatus.COMPLETING).update(
        status=UploadStatus.OPEN, expires=expires
    )
    upload.status, upload.expires = UploadStatus.OPEN, expires


def _complete_direct(
    upload: Upload, parts: list[UploadPart], rules: KindRules, *, user: User, ip: str | None
) -> Upload:
    try:
        blob = _verify_direct(upload, parts, rules)
    except _ReopenError as reopen:
        _reopen(upload)
        raise reopen.error from None
    except DVBenchError as error:
        _fail(upload, error, user=user, ip=ip)
        raise
    except BaseException:
        _reopen(upload)  # S3 unreachable, say: completing again resumes where this stopped
        raise
    try:
        _record_completion(upload, blob, rules, user=user, ip=ip)
    except DVBenchError as error:
        _fail(upload, error, user=user, ip=ip)
        raise
    _discard_direct(upload)
    return upload


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
    _discard_direct(locked)
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
            _reopen(stuck)
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
            names = _drop_parts(locked)
            Upload.objects.filter(pk=pk).update(status=UploadStatus.ABORTED, reason="expired")
        _delete_files(names)
        _discard_direct(locked)
        count += 1
    return count
