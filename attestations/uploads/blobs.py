"""The content-addressed blob store on local disk: temporary files beside it, joining parts,
moving a verified file to ``blobs/sha256/ab/cd/<hex>``, and reading a stored file mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import IntegrityError

from attestations.uploads import disk, sha256state
from attestations.uploads.errors import DigestMismatchError
from attestations.uploads.models import Blob, Upload, UploadPart

log = logging.getLogger(__name__)


# Measured on the 2-core CI machine (bench/bench_api.py): gunicorn reads a body in steps
# of at most 1 MiB, and reading it in 1 MiB chunks costs the web worker ~7 s of CPU per
# GiB received against ~9 s in 256 KiB chunks; 4 MiB chunks were slower again (large
# fresh buffers cost more than the calls they save).
CHUNK_BYTES = 1024 * 1024


def tmp_dir() -> Path:
    # Beside the media root, so a FileSystemStorage save is a rename, not a copy.
    path = Path(str(settings.DVBENCH["DATA_DIR"])) / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


class LocalFile(File):  # type: ignore[type-arg]
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
def temporary_path(suffix: str) -> Iterator[Path]:
    descriptor, name = tempfile.mkstemp(dir=tmp_dir(), suffix=suffix)
    os.close(descriptor)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def delete_quietly(name: str) -> None:
    try:
        default_storage.delete(name)
    except OSError:  # pragma: no cover - storage already gone; nothing left to clean
        log.warning("could not delete staged file %s", name, exc_info=True)


def sync(out: IO[bytes]) -> None:
    out.flush()
    # Durable before it is registered: a crash must not leave a row naming lost bytes.
    os.fsync(out.fileno())


class Whole:
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


def assemble(parts: list[UploadPart], path: Path) -> str:
    """Concatenate the parts into ``path``; returns the SHA-256 of the whole.

    Parts sent in order were hashed into the whole as they were written (their chain of
    states), so only the parts after the chain's end are read and hashed here: in-order
    uploads cost one hash per byte. The bytes were hashed as they arrived and made
    durable before their part was recorded; the copy that joins them is checked by size.
    """
    whole = Whole(parts)
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
        sync(out)
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
            path = stack.enter_context(temporary_path(".blob"))
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


def adopt(source: Path, sha256: str, size: int) -> Blob:
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


def store(path: Path, sha256: str, size: int) -> Blob:
    """Save the verified file under its content address, or reuse the blob already there."""
    existing = Blob.objects.filter(sha256=sha256).first()
    if existing is not None and default_storage.exists(existing.storage_name):
        return existing
    address = Blob.address(sha256)
    if default_storage.exists(address):
        # No row claims it: a leftover of a crash between save and insert. Our bytes
        # hash to the same address, so replacing it is safe.
        default_storage.delete(address)
    name = default_storage.save(address, LocalFile(path))
    try:
        blob, created = Blob.objects.get_or_create(
            sha256=sha256, defaults={"size": size, "storage_name": name}
        )
    except IntegrityError:  # pragma: no cover - lost a race with the same digest
        blob, created = Blob.objects.get(sha256=sha256), False
    if not created:
        if blob.storage_name != name:
            delete_quietly(name)
        if existing is not None and blob.storage_name != name:
            Blob.objects.filter(pk=blob.pk).update(storage_name=name)
    return blob


def check_whole_digest(upload: Upload, got: str) -> None:
    if got != upload.sha256:
        raise DigestMismatchError(
            "sha256 of the assembled upload",
            upload.sha256,
            got,
            code="blob_digest_mismatch",
            field="sha256",
        )
