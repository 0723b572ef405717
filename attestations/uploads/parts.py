"""Parts sent through the API: reserved against the declared size, streamed to disk while
hashed, checked against their declared digest and registered under the upload's row lock.

A part sent in order is written in place into the upload's data file
(:mod:`attestations.uploads.disk`) and hashed on into the whole file's digest
(:mod:`attestations.uploads.sha256state`); any other part goes to a file of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from django.core.files.storage import default_storage
from django.db import DatabaseError, transaction
from django.utils import timezone

from attestations.core.errors import (
    ConflictError,
    InvalidRequestError,
    PayloadTooLargeError,
)
from attestations.uploads import blobs, disk, limits, sha256state, transitions
from attestations.uploads.errors import (
    DigestMismatchError,
    IncompleteBodyError,
    UploadNotOpenError,
)
from attestations.uploads.models import PartReservation, Upload, UploadPart, UploadStatus

log = logging.getLogger(__name__)


class Body(Protocol):
    """A part's bytes: any binary stream; one with ``readinto`` is read without a copy."""

    def read(self, size: int, /) -> bytes: ...


#: A part reservation older than this belongs to a request that died without releasing
#: it (a killed worker). Longer than any request lives (gunicorn's ``timeout`` is 120 s,
#: ``platform/gunicorn.conf.py``).
RESERVATION_SECONDS = 600


def _reserve(upload: Upload, number: int, size: int) -> int:
    """Claim ``size`` bytes of the declared size for part ``number``; returns the claim's id.

    The bytes count against the declared size from before the body is read until the part
    is registered or refused, so parts sent in parallel cannot together stage more than
    was declared. A part already received or in flight under ``number`` does not count:
    sending it again replaces it (a retried PUT of a complete set of parts is accepted).
    """
    now = timezone.now()
    with transaction.atomic():
        locked = transitions.lock(upload)
        transitions.require_open(locked, "part")
        locked.reservations.filter(
            created__lt=now - timedelta(seconds=RESERVATION_SECONDS)
        ).delete()
        # Claims of the same number are left out, as its received part is: copies of one
        # part replace each other, and a retry must not be refused for the claim of the
        # attempt it retries (cut off mid-body, its request not yet ended).
        others = locked.reservations.exclude(number=number)
        total = (
            limits.total_size(locked.parts.exclude(number=number))
            + limits.total_size(others)
            + size
        )
        if total > locked.size:
            raise limits.size_exceeded(number, total, locked.size)
        return PartReservation.objects.create(upload=locked, number=number, size=size).pk


def _release(reservation: int | None) -> None:
    if reservation is None:
        return
    try:
        PartReservation.objects.filter(pk=reservation).delete()
    except DatabaseError:  # the database is what failed; the claim lapses on its own
        log.warning("could not release part reservation %s", reservation, exc_info=True)


def _stream_to_file(
    stream: Body,
    target: Path | disk.Slot,
    limit: int,
    number: int,
    expected: int | None,
    chain: sha256state.ResumableSHA256 | None = None,
) -> tuple[int, str]:
    """Copy ``stream`` to ``target`` in chunks, hashing as it goes; never more than ``limit``.

    ``target`` is a file of the part's own, or its slot in the upload's data file. The
    chunks are read into two buffers used in turn (``readinto``, where the stream has it:
    the API's :class:`~attestations.http.body.RequestBody` does), so a part allocates no
    memory per chunk.

    With ``expected`` (the Content-Length) reads no more than that, and raises
    :class:`IncompleteBodyError` when the body ends before it. With ``chain`` (the whole
    file's digest so far) each chunk is hashed into it too, in a second thread while this
    one hashes the part's own digest, writes and reads the next chunk into the other
    buffer: both hashes release the GIL, so the part costs one hash's time, not two.
    """
    digest = hashlib.sha256()
    size = 0
    read = _reader(stream)
    buffers = (memoryview(bytearray(blobs.CHUNK_BYTES)), memoryview(bytearray(blobs.CHUNK_BYTES)))
    with contextlib.ExitStack() as stack:
        out: Any = (
            target if isinstance(target, disk.Slot) else stack.enter_context(open(target, "wb"))
        )
        pool = None
        if chain is not None:
            pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="dvbench-chain"))
        chained: Any = None
        turn = 0
        while True:
            # The other buffer may still be hashed into the chain; this one is free.
            buffer = buffers[turn]
            turn ^= 1
            want = blobs.CHUNK_BYTES if expected is None else min(len(buffer), expected - size)
            count = read(buffer[:want]) if want > 0 else 0
            if not count:
                break
            chunk = buffer[:count]
            size += count
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
            blobs.sync(out)
    return size, digest.hexdigest()


def _reader(stream: Body) -> Any:
    """``stream``'s ``readinto``, or one made of its ``read``."""
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        return readinto

    def read(view: memoryview) -> int:
        data = stream.read(len(view))
        view[: len(data)] = data
        return len(data)

    return read


def _check_part_request(
    upload: Upload, number: int, declared_sha256: str | None, content_length: int | None
) -> tuple[str, int]:
    """The part request's own shape (number, digest header, length), before the upload's
    state: a malformed request is a 400 whatever state the upload is in. Returns the
    declared digest, normalised, and the part limit."""
    limits.check_part_number(number)
    declared = (declared_sha256 or "").strip().lower()
    if len(declared) != 64 or any(c not in "0123456789abcdef" for c in declared):
        raise InvalidRequestError(
            f"header {limits.PART_DIGEST_HEADER} must be the part's lowercase hex SHA-256 "
            f"(64 characters), got {declared_sha256!r}",
            code="missing_part_digest" if not declared else "invalid_part_digest",
            field=limits.PART_DIGEST_HEADER,
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
    limit = limits.max_part_bytes()
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
    stream: Body,
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
            transitions.require_open(transitions.lock(upload), "part")
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
            target = slot or stack.enter_context(blobs.temporary_path(".part"))
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
                    field=limits.PART_DIGEST_HEADER,
                )
            after = None if chain is None else chain.state()
            part, replaced = _register(
                upload, number, target, size, got, reservation, chain=(base, after)
            )
    except UploadNotOpenError:
        # Whether or not this request wrote in place: a claim that lost its race with
        # the close may have created the data file before it gave the range up.
        _discard_if_closed(upload)
        raise
    finally:
        _release(reservation)
    if replaced and replaced not in (part.storage_name, disk.data_name(upload)):
        blobs.delete_quietly(replaced)
    return part


def _abandon_unless_stored(slot: disk.Slot, upload: Upload, number: int) -> None:
    """A refused in-place part leaves nothing behind (runs before its slot is unlocked)."""
    stored = UploadPart.objects.filter(
        upload=upload, number=number, storage_name=slot.name, offset=slot.offset
    ).exists()
    if not stored:
        slot.abandon()


def _discard_if_closed(upload: Upload) -> None:
    """Remove the data file of a closed upload, which a refused part may have left.

    Abort, expiry, failure and completion remove (or rename) the data file; a request
    that was already claiming or writing in place may have created it again. Nothing
    reads it then.
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
            locked = transitions.lock(upload)
            transitions.require_open(locked, "part")
            total = limits.total_size(locked.parts.exclude(number=number)) + size
            if total > locked.size:
                raise limits.size_exceeded(number, total, locked.size)
            if isinstance(target, disk.Slot):
                offset: int | None = target.offset
                name = target.name
            else:
                offset = None
                # A fresh staging name per attempt: a concurrent retry of the same part
                # never overwrites a file another request is about to register.
                name = default_storage.save(
                    f"{upload.part_name(number)}.{secrets.token_hex(4)}", blobs.LocalFile(target)
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
            blobs.delete_quietly(name)
        raise
    return part, replaced
