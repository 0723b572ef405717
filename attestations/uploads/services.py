"""Resumable, content-addressed multipart uploads through Django's storage API.

The life of an upload:

1. ``create``: the client declares kind, total size and the SHA-256 of the whole blob.
2. ``put_part``: each part is streamed to a local temporary file while it is hashed and
   counted, checked against the ``X-Part-SHA256`` header, then saved under the staging
   prefix ``staging/uploads/<id>/``. Putting the same part again replaces it, so a
   retried request is harmless (PUT is idempotent).
3. ``complete``: the parts (which must be 1..N with sizes summing to the declared size)
   are concatenated into a temporary file while the whole digest is computed. Only if it
   matches is the file saved under its content address ``blobs/sha256/ab/cd/<hex>``; a
   blob already stored under that address is reused. The staged parts are then removed.
4. ``abort``: the staged parts are removed.

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
from django.db import IntegrityError, transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import DVBenchError, InvalidRequestError, PayloadTooLargeError
from attestations.experiments.models import Experiment
from attestations.uploads.errors import (
    DigestMismatchError,
    MissingPartsError,
    SizeExceededError,
    UploadNotOpenError,
)
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus

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


# --- parts ------------------------------------------------------------------------------


def _require_open(upload: Upload) -> None:
    if upload.status != UploadStatus.OPEN:
        raise UploadNotOpenError(
            f"upload {upload.id} is {upload.status}; parts can only be sent to an open upload",
            field="status",
            detail={"status": upload.status},
        )


def _stream_to_file(stream: IO[bytes], path: Path, limit: int, number: int) -> tuple[int, str]:
    """Copy ``stream`` to ``path`` in chunks, hashing as it goes; never more than ``limit``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as out:
        while chunk := stream.read(CHUNK_BYTES):
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

    Raises:
        UploadNotOpenError: the upload was completed, aborted or failed.
        InvalidRequestError: bad part number or missing/malformed digest header.
        PayloadTooLargeError: the body exceeds ``MAX_PART_BYTES``.
        DigestMismatchError: the body does not hash to the declared digest.
        SizeExceededError: the parts would exceed the upload's declared size (409).
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
    limit = max_part_bytes()
    if content_length is not None and content_length > limit:
        raise PayloadTooLargeError(
            f"part {number}: Content-Length {content_length} exceeds the part limit of "
            f"{limit} bytes",
            code="part_too_large",
            field="Content-Length",
            detail={"limit": limit, "got": content_length},
        )
    _require_open(upload)
    with _temporary_path(".part") as path:
        size, got = _stream_to_file(stream, path, limit, number)
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
        others = int(sum(upload.parts.exclude(number=number).values_list("size", flat=True)) or 0)
        if others + size > upload.size:
            raise SizeExceededError(
                f"part {number}: the parts would hold {others + size} bytes, more than the "
                f"declared size of {upload.size}",
                code="size_exceeded",
                field="body",
                detail={"expected": upload.size, "got": others + size},
            )
        # A fresh staging name per attempt: a concurrent retry of the same part never
        # overwrites a file another request is about to register.
        name = default_storage.save(
            f"{upload.part_name(number)}.{secrets.token_hex(4)}", _LocalFile(path)
        )
    replaced: str | None = None
    try:
        with transaction.atomic():
            locked = Upload.objects.select_for_update().get(pk=upload.pk)
            _require_open(locked)
            part = UploadPart.objects.filter(upload=locked, number=number).first()
            if part is None:
                part = UploadPart(upload=locked, number=number)
            else:
                replaced = part.storage_name
            part.size, part.sha256, part.storage_name = size, got, name
            part.created = timezone.now()
            part.save()
    except BaseException:
        _delete_quietly(name)
        raise
    if replaced and replaced != name:
        _delete_quietly(replaced)
    return part


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


def _discard(upload: Upload, status: str, reason: str) -> None:
    """Remove every staged part and close the upload as ``status``."""
    for part in list(upload.parts.all()):
        _delete_quietly(part.storage_name)
    upload.parts.all().delete()
    Upload.objects.filter(pk=upload.pk).update(status=status, reason=reason[:64])
    upload.status, upload.reason = status, reason[:64]


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

    Completing an already completed upload returns it unchanged (a retried request).

    Raises:
        MissingPartsError: parts missing or of the wrong total size (409 ``missing_parts``
            or ``size_mismatch``); the upload stays open so the client can send what is
            missing.
        DigestMismatchError: the assembled bytes do not hash to the declared digest; the
            upload fails and its parts are removed.
        UploadNotOpenError: the upload was aborted or failed.
        DVBenchError: the kind's rules refused it (a transcript naming another experiment
            or spec is ``TranscriptRejectedError``, past the experiment's proofs
            ``TooManyProofsError``); a refusal of the file fails the upload.
    """
    if upload.status == UploadStatus.COMPLETE:
        return upload
    _require_open(upload)
    parts = _check_parts(upload)
    rules = rules_for(upload.kind)
    rules.before_complete(upload)
    claimed = Upload.objects.filter(pk=upload.pk, status=UploadStatus.OPEN).update(
        status=UploadStatus.COMPLETING
    )
    if not claimed:
        upload.refresh_from_db()
        if upload.status == UploadStatus.COMPLETE:
            return upload
        _require_open(upload)
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
        _discard(upload, UploadStatus.FAILED, error.error_code)
        AuditEvent.record(
            "upload.failed",
            actor=user,
            organization=upload.experiment.owner,
            target=upload,
            detail={"reason": error.error_code, "message": error.message},
            ip=ip,
        )
        raise
    except BaseException:
        # Anything unexpected (storage down): the session may be completed again.
        Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.OPEN)
        raise
    try:
        _record_completion(upload, blob, rules, user=user, ip=ip)
    except DVBenchError as error:
        # Refused by the kind's owner now (another transcript took the experiment's last
        # place since the check above, say): nothing was recorded.
        _discard(upload, UploadStatus.FAILED, error.error_code)
        raise
    for part in parts:
        _delete_quietly(part.storage_name)
    upload.parts.all().delete()
    return upload


def _record_completion(
    upload: Upload, blob: Blob, rules: KindRules, *, user: User, ip: str | None
) -> None:
    with transaction.atomic():
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


# --- abort ------------------------------------------------------------------------------


def abort(upload: Upload, *, user: User, ip: str | None = None) -> Upload:
    """Remove the staged parts of an open upload; aborting twice is harmless."""
    if upload.status == UploadStatus.ABORTED:
        return upload
    _require_open(upload)
    _discard(upload, UploadStatus.ABORTED, "aborted")
    AuditEvent.record(
        "upload.aborted", actor=user, organization=upload.experiment.owner, target=upload, ip=ip
    )
    return upload


def expire_stale(now: Any = None) -> int:
    """Abort open uploads past their expiry; returns how many were removed."""
    stale = Upload.objects.filter(status=UploadStatus.OPEN, expires__lt=now or timezone.now())
    count = 0
    for upload in stale:
        _discard(upload, UploadStatus.ABORTED, "expired")
        count += 1
    return count
