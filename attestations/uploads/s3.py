"""Direct uploads: the S3 calls behind them, with no byte passing through the web worker.

With S3 storage (``DVBENCH_S3_BUCKET``) and ``DVBENCH_S3_DIRECT_UPLOADS`` on (the
default), an upload is an S3 multipart upload of the staging object
``staging/uploads/<id>/object``, created with ``ChecksumAlgorithm=SHA256``. The client
PUTs each part to a presigned ``UploadPart`` URL the platform issues
(``POST uploads/<id>/parts/<n>/url/``); its signature binds the bucket, the key, the
upload id, the part number, ``Content-Length`` and ``x-amz-checksum-sha256`` (the part's
declared size and SHA-256), and expires after ``DVBENCH_S3_PRESIGN_SECONDS``.

Completion reads only S3's answers (``services.complete``): ``ListParts`` (sizes, and
per-part SHA-256 where the store reports them), ``CompleteMultipartUpload`` with every
part's SHA-256, ``HeadObject`` with ``ChecksumMode=ENABLED`` (the composite checksum,
SHA-256 of the parts' SHA-256s, compared with the one the declarations give), then the
whole file's SHA-256, the content address, which is never taken from the client: a
server-side ``CopyObject`` of the staging object onto itself with
``ChecksumAlgorithm=SHA256`` (up to ``DVBENCH_S3_COPY_MAX_BYTES``, 5 GiB, S3's limit of
one copy) makes S3 hash it; above that the worker streams the object from S3 once and
hashes it (S3 offers no whole-object SHA-256 for an object assembled from parts).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.storage import default_storage

#: S3's smallest part, except the last one (``EntityTooSmall`` at completion otherwise).
MIN_PART_BYTES = 5 * 1024 * 1024
#: S3's largest object one ``CopyObject`` may copy.
COPY_LIMIT_BYTES = 5 * 1024**3
#: Read size of the streaming hash pass (objects above the copy limit).
STREAM_BYTES = 8 * 1024 * 1024


class S3Error(Exception):
    """An error answer of S3 (botocore's ``ClientError``, which only the s3 extra has)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    from botocore.exceptions import ClientError  # type: ignore[import-untyped]

    try:
        yield
    except ClientError as error:
        answer = error.response.get("Error", {})
        raise S3Error(str(answer.get("Code")), str(answer.get("Message"))) from error


def enabled() -> bool:
    """Whether new uploads go straight to S3: S3 storage, and direct uploads not turned off."""
    if not settings.DVBENCH["S3_DIRECT_UPLOADS"]:
        return False
    try:
        from storages.backends.s3 import S3Storage
    except ImportError:  # pragma: no cover - the s3 extra is not installed
        return False
    # A LazyObject proxies ``__class__``, so this asks the configured storage.
    return isinstance(default_storage, S3Storage)


_CLIENT_LOCK = threading.Lock()


def client(*, public: bool = False) -> Any:
    """A boto3 client on default storage's bucket, credentials and endpoint.

    Its own, not the storage's: presigned URLs must be SigV4 (SigV2 signs neither
    ``Content-Length`` nor ``x-amz-checksum-sha256``), and the platform asks S3 for
    checksums explicitly instead of having botocore add and validate its own (a store
    that reports a multipart object's composite checksum as a whole one, as moto 5.2 does
    on GET, would fail every read). One per storage object, made once (boto3 clients
    are thread-safe, their creation is not, and it costs tens of milliseconds).
    """
    storage: Any = _load()
    endpoint = storage.endpoint_url
    if public and settings.DVBENCH["S3_PUBLIC_ENDPOINT_URL"]:
        endpoint = settings.DVBENCH["S3_PUBLIC_ENDPOINT_URL"]
    slot = f"_dvbench_direct_{endpoint}"
    made = storage.__dict__.get(slot)
    if made is not None:
        return made
    with _CLIENT_LOCK:
        made = storage.__dict__.get(slot)
        if made is None:
            from botocore.config import Config  # type: ignore[import-untyped]

            config = storage.client_config.merge(
                Config(
                    signature_version="s3v4",
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
            )
            made = storage._create_session().client(
                "s3",
                region_name=storage.region_name,
                use_ssl=storage.use_ssl,
                endpoint_url=endpoint,
                config=config,
                verify=storage.verify,
            )
            storage.__dict__[slot] = made
    return made


def _load() -> Any:
    """The storage object behind the ``default_storage`` proxy."""
    from django.utils.functional import empty

    if default_storage._wrapped is empty:  # type: ignore[attr-defined]
        default_storage._setup()  # type: ignore[attr-defined]
    return default_storage._wrapped  # type: ignore[attr-defined]


def bucket() -> str:
    return str(default_storage.bucket_name)  # type: ignore[attr-defined]


def key(name: str) -> str:
    """The object key of a storage name (default storage's ``location`` prefixed)."""
    return str(default_storage._normalize_name(name))  # type: ignore[attr-defined]


def b64(hex_digest: str) -> str:
    """S3's form of a SHA-256: base64 of the 32 bytes."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def hex_of(b64_digest: str) -> str:
    """A SHA-256 as S3 reports it (base64, maybe with ``-N``) in lowercase hex."""
    return base64.b64decode(b64_digest.split("-", 1)[0]).hex()


def composite(hex_digests: list[str]) -> str:
    """S3's composite checksum of a multipart object: SHA-256 of the parts' SHA-256s (hex)."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in hex_digests)).hexdigest()


def create_multipart(name: str) -> str:
    """Start the S3 multipart upload of ``name``; returns S3's upload id."""
    answer = client().create_multipart_upload(
        Bucket=bucket(), Key=key(name), ChecksumAlgorithm="SHA256"
    )
    return str(answer["UploadId"])


def presign_part(
    name: str, upload_id: str, number: int, size: int, sha256: str, expires: int
) -> tuple[str, dict[str, str]]:
    """A presigned ``UploadPart`` URL and the headers the PUT must carry (all signed)."""
    checksum = b64(sha256)
    # Signed for the endpoint the client reaches (the host is part of the signature).
    url = client(public=True).generate_presigned_url(
        "upload_part",
        Params={
            "Bucket": bucket(),
            "Key": key(name),
            "UploadId": upload_id,
            "PartNumber": number,
            "ContentLength": size,
            "ChecksumSHA256": checksum,
        },
        ExpiresIn=expires,
    )
    return str(url), {"Content-Length": str(size), "x-amz-checksum-sha256": checksum}


@dataclass(frozen=True)
class StoredPart:
    """One part as S3 lists it."""

    number: int
    size: int
    etag: str
    modified: datetime
    #: Hex SHA-256 as S3 reports it; None where the store reports none (moto 5.2).
    sha256: str | None


def list_parts(name: str, upload_id: str) -> dict[int, StoredPart]:
    """The parts S3 holds for the multipart upload (``ListParts``, every page)."""
    found: dict[int, StoredPart] = {}
    pages = (
        client()
        .get_paginator("list_parts")
        .paginate(Bucket=bucket(), Key=key(name), UploadId=upload_id)
    )
    with _translated():
        pages = list(pages)
    for page in pages:
        for item in page.get("Parts", []):
            checksum = item.get("ChecksumSHA256")
            found[int(item["PartNumber"])] = StoredPart(
                number=int(item["PartNumber"]),
                size=int(item["Size"]),
                etag=str(item["ETag"]),
                modified=item["LastModified"],
                sha256=hex_of(checksum) if checksum else None,
            )
    return found


def complete_multipart(name: str, upload_id: str, parts: list[tuple[int, str, str]]) -> None:
    """``CompleteMultipartUpload`` with ``(number, etag, sha256 hex)`` of every part."""
    with _translated():
        client().complete_multipart_upload(
            Bucket=bucket(),
            Key=key(name),
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [
                    {"PartNumber": number, "ETag": etag, "ChecksumSHA256": b64(sha256)}
                    for number, etag, sha256 in parts
                ]
            },
        )


def head(name: str) -> tuple[int, str | None]:
    """``(size, composite or whole SHA-256 in hex or None)`` of a stored object."""
    answer = client().head_object(Bucket=bucket(), Key=key(name), ChecksumMode="ENABLED")
    checksum = answer.get("ChecksumSHA256")
    return int(answer["ContentLength"]), hex_of(checksum) if checksum else None


def whole_sha256(name: str, size: int) -> str:
    """The SHA-256 of a stored object's bytes, computed by S3 where it can (hex).

    Up to ``DVBENCH_S3_COPY_MAX_BYTES`` the object is copied onto itself with
    ``ChecksumAlgorithm=SHA256`` and S3 reports the digest of the bytes it copied; above
    it the object is read once, streamed, and hashed here.
    """
    limit = int(settings.DVBENCH["S3_COPY_MAX_BYTES"])
    if size <= min(limit, COPY_LIMIT_BYTES):
        answer = client().copy_object(
            Bucket=bucket(),
            Key=key(name),
            CopySource={"Bucket": bucket(), "Key": key(name)},
            ChecksumAlgorithm="SHA256",
            MetadataDirective="REPLACE",
        )
        checksum = answer.get("CopyObjectResult", {}).get("ChecksumSHA256")
        if checksum:
            return hex_of(checksum)
    digest = hashlib.sha256()
    for chunk in _stream(name):
        digest.update(chunk)
    return digest.hexdigest()


def _stream(name: str) -> Iterator[bytes]:
    body = client().get_object(Bucket=bucket(), Key=key(name))["Body"]
    try:
        while chunk := body.read(STREAM_BYTES):
            yield chunk
    finally:
        body.close()


def download(name: str, path: Path) -> None:
    """Copy a stored object to a local file (for a kind whose owner checks the file)."""
    with open(path, "wb") as out:
        for chunk in _stream(name):
            out.write(chunk)


def copy(source: str, target: str) -> None:
    """Copy one stored object to another name, inside S3 (part copies above 5 GiB)."""
    from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

    # One CopyObject up to S3's limit, with S3's SHA-256 of the whole stored beside it.
    client().copy(
        CopySource={"Bucket": bucket(), "Key": key(source)},
        Bucket=bucket(),
        Key=key(target),
        ExtraArgs={"ChecksumAlgorithm": "SHA256"},
        Config=TransferConfig(multipart_threshold=COPY_LIMIT_BYTES),
    )


def discard(name: str, upload_id: str) -> None:
    """Abort the multipart upload and delete the staging object; either may be gone."""
    s3 = client()
    with contextlib.suppress(s3.exceptions.NoSuchUpload):
        s3.abort_multipart_upload(Bucket=bucket(), Key=key(name), UploadId=upload_id)
    s3.delete_object(Bucket=bucket(), Key=key(name))
