"""Direct uploads: the parts go straight to object storage.

With S3 storage the client PUTs each part to a presigned URL (``uploads/s3.py``); the
platform records each part's declared size and SHA-256 as an ``UploadPart`` without a
staged file, and at completion checks what S3 holds against the declarations, reading
S3's answers only: no byte of a snapshot passes through the web worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.utils import timezone

from attestations.core.conf import dvbench_int
from attestations.core.errors import (
    ConflictError,
    DVBenchError,
    InvalidRequestError,
    PayloadTooLargeError,
)
from attestations.uploads import blobs, limits, s3, transitions
from attestations.uploads.errors import (
    DigestMismatchError,
    IncompleteBodyError,
    MissingPartsError,
    SizeExceededError,
)
from attestations.uploads.kinds import KindRules
from attestations.uploads.models import Blob, Upload, UploadPart, UploadStatus

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
    limits.check_part_number(number)
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
    limit = limits.max_part_bytes()
    if size > limit:
        raise PayloadTooLargeError(
            f"part {number}: size {size} exceeds the part limit of {limit} bytes",
            code="part_too_large",
            field="size",
            detail={"limit": limit, "got": size},
        )
    lifetime = dvbench_int("S3_PRESIGN_SECONDS")
    with transaction.atomic():
        locked = transitions.lock(upload)
        transitions.require_open(locked, "part")
        total = limits.total_size(locked.parts.exclude(number=number)) + size
        if total > locked.size:
            error = limits.size_exceeded(number, total, locked.size)
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
    blobs.check_whole_digest(upload, s3.whole_sha256(name, upload.size))
    if type(rules).check_file is not KindRules.check_file:
        # The kind's owner reads the file (a transcript's root record): it is fetched
        # once. Snapshots, batches and artifacts are never read here.
        with blobs.temporary_path(".blob") as path:
            s3.download(name, path)
            rules.check_file(upload, path)
    return _store_direct_blob(name, upload.sha256, upload.size)


def complete(
    upload: Upload, parts: list[UploadPart], rules: KindRules, *, user: User, ip: str | None
) -> Upload:
    try:
        blob = _verify_direct(upload, parts, rules)
    except _ReopenError as reopen:
        transitions.reopen(upload)
        raise reopen.error from None
    except DVBenchError as error:
        transitions.fail(upload, error, user=user, ip=ip)
        raise
    except BaseException:
        transitions.reopen(
            upload
        )  # S3 unreachable, say: completing again resumes where this stopped
        raise
    try:
        transitions.record_completion(upload, blob, rules, user=user, ip=ip)
    except DVBenchError as error:
        transitions.fail(upload, error, user=user, ip=ip)
        raise
    transitions.discard_direct(upload)
    return upload
