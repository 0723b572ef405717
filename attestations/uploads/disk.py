"""Parts on local disk, and the blob they make.

On local storage (the demo's ``FileSystemStorage``) the parts of an upload that arrive
in order are written into one data file, ``staging/uploads/<id>/data``: part ``n`` at
the offset where part ``n - 1`` ends. An upload whose parts all lie there end to end
*is* its blob, and completion renames the file into place: no byte is copied or hashed
again. A part that comes before its predecessor, or is sent again after a part of its
number was stored, is written to a file of its own, and completion joins the pieces
with the kernel's copy (``copy_file_range``) while it hashes what the parts' chain of
digest states does not cover.

Two requests never write one range at once: the writer of a range holds an exclusive
open-file-description lock on it (``F_OFD_SETLK``, Linux; it conflicts between threads
of one process too) from before its first byte until its part is registered, and a
request that cannot take it writes a file of its own. A part is written in place only
while no part of its number is stored, so the bytes of a stored part are never written
again. Where the lock is not available, every part gets its own file.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from django.core.files.storage import default_storage

from attestations.uploads.models import Upload, UploadPart

try:
    import fcntl

    _OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
except ImportError:  # pragma: no cover - not a POSIX system
    _OFD_SETLK = None

#: ``struct flock`` on Linux: ``l_type``, ``l_whence``, ``l_start``, ``l_len``, ``l_pid``
#: (zero for open-file-description locks), padded to its C size.
_FLOCK = "hhqqi4x"
#: Reading already-stored parts into one reused buffer, larger reads cost less.
BUFFER_BYTES = 1024 * 1024
#: ``copy_file_range`` errors that mean "not here": fall back to reading and writing.
_NO_COPY_FILE_RANGE = frozenset({errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP})


def data_name(upload: Upload) -> str:
    """The storage name of the upload's data file (its parts written in place)."""
    return f"{upload.staging_prefix}/data"


def local_path(name: str) -> Path | None:
    """The file behind a storage name, when storage is a local filesystem."""
    try:
        return Path(default_storage.path(name))
    except NotImplementedError:  # remote storage (S3): no paths
        return None


def _offset(upload: Upload, number: int) -> int | None:
    """Where part ``number`` goes in the data file: where part ``number - 1`` ends there.

    None when a part of this number is stored (its bytes stay as they are) or the part
    before it is not in the data file.
    """
    rows = {
        row.number: row
        for row in UploadPart.objects.filter(upload=upload, number__in=(number - 1, number))
    }
    if number in rows:
        return None
    if number == 1:
        return 0
    before = rows.get(number - 1)
    if before is None or before.offset is None:
        return None
    return before.offset + before.size


class Slot:
    """A locked range of the upload's data file, written by one request.

    ``write`` appends to the range, ``sync`` makes it durable; closing the slot (after
    the part is registered, or refused) releases the lock.
    """

    def __init__(self, descriptor: int, name: str, path: Path, offset: int) -> None:
        self.descriptor = descriptor
        self.name = name
        self.path = path
        self.offset = offset
        self.written = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            count = os.pwrite(self.descriptor, view, self.offset + self.written)
            self.written += count
            view = view[count:]

    def sync(self) -> None:
        # Durable before it is registered: a crash must not leave a row naming lost bytes.
        os.fdatasync(self.descriptor)

    def abandon(self) -> None:
        """Take back what this refused part wrote: nothing after it is stored (a part
        goes in place only after its predecessor), so the file is cut where the part
        began, and removed when the part was its first."""
        if self.descriptor < 0:
            return
        if self.offset == 0:
            self.path.unlink(missing_ok=True)
        else:
            os.ftruncate(self.descriptor, self.offset)

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)  # releases the range lock
            self.descriptor = -1

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def claim(upload: Upload, number: int, size: int | None) -> Slot | None:
    """The range of the data file where part ``number`` of ``size`` bytes goes, locked.

    None when the part gets a file of its own: storage is not local, the range lock is
    not available here, the part comes before its predecessor or after a part of its
    number was stored, or another request is writing the range.
    """
    if _OFD_SETLK is None or size is None or size <= 0:
        return None
    name = data_name(upload)
    path = local_path(name)
    if path is None:
        return None
    offset = _offset(upload, number)
    if offset is None:
        return None
    # Only the first part creates the file. A later part's predecessor lies in it, so a
    # missing file was removed by an abort, an expiry or a completion since _offset
    # read the rows: creating it again would leave a file no row names.
    flags = os.O_WRONLY | os.O_CLOEXEC
    if offset == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags |= os.O_CREAT
    try:
        descriptor = os.open(path, flags, 0o644)
    except FileNotFoundError:
        return None
    try:
        lock = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, size, 0)
        fcntl.fcntl(descriptor, _OFD_SETLK, lock)
    except OSError:  # another request writes this range: this one gets its own file
        os.close(descriptor)
        return None
    # Under the lock, once more: a part of this number stored by a request that held the
    # range a moment ago keeps its bytes; and the file opened must still be the upload's
    # data file (a refused first part, an abort or a completion may have removed or
    # renamed it since: such a file is never written).
    if _offset(upload, number) != offset or not _same_file(descriptor, path):
        os.close(descriptor)
        return None
    return Slot(descriptor, name, path, offset)


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def discard(upload: Upload) -> None:
    """Remove the data file (of an upload that is closed: nothing will read it)."""
    path = local_path(data_name(upload))
    if path is not None:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Segment:
    """``size`` bytes of the file at ``path`` from ``offset``: one stored part."""

    path: Path
    offset: int
    size: int


def segments(parts: Sequence[UploadPart]) -> list[Segment] | None:
    """Where each part's bytes lie on local disk, in part order; None on remote storage."""
    found = []
    for part in parts:
        path = local_path(part.storage_name)
        if path is None:
            return None
        found.append(Segment(path, part.offset or 0, part.size))
    return found


def in_place(upload: Upload, parts: Sequence[UploadPart]) -> Path | None:
    """The data file when it holds every part end to end from its start, else None."""
    name = data_name(upload)
    end = 0
    for part in parts:
        if part.storage_name != name or part.offset != end:
            return None
        end += part.size
    return local_path(name) if parts else None


def settle(path: Path, size: int) -> None:
    """Cut the data file to the upload's size (a refused write may have run past it)."""
    with open(path, "r+b") as handle:
        if os.fstat(handle.fileno()).st_size != size:
            handle.truncate(size)
            os.fsync(handle.fileno())


def hash_segments(pieces: Sequence[Segment], update: Callable[[memoryview], None]) -> None:
    """Feed the bytes of ``pieces`` to ``update``, in order, through one reused buffer."""
    buffer = bytearray(BUFFER_BYTES)
    view = memoryview(buffer)
    for piece in pieces:
        with open(piece.path, "rb", buffering=0) as handle:
            handle.seek(piece.offset)
            left = piece.size
            while left:
                count = handle.readinto(view[: min(left, BUFFER_BYTES)])
                if not count:
                    raise OSError(f"{piece.path} ends {left} bytes before its part does")
                update(view[:count])
                left -= count


def _copy_range(source: int, target: int, offset: int, size: int) -> None:
    """Append ``size`` bytes of ``source`` from ``offset`` to ``target``, in the kernel.

    ``copy_file_range`` copies page cache to page cache, so no byte passes through Python;
    a kernel or filesystem without it gets a read/write loop for what is left.
    """
    done = 0
    try:
        while done < size:
            copied = os.copy_file_range(
                source, target, min(size - done, 1 << 30), offset_src=offset + done
            )
            if copied == 0:
                break
            done += copied
    except OSError as error:
        # Not supported here (an old kernel, across filesystems): copy the rest by hand.
        # Anything else (a full disk) is an error of the completion.
        if error.errno not in _NO_COPY_FILE_RANGE:
            raise
    while done < size:
        chunk = os.pread(source, min(size - done, BUFFER_BYTES), offset + done)
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            view = view[os.write(target, view) :]
        done += len(chunk)


def concatenate(pieces: Sequence[Segment], path: Path) -> None:
    """Join ``pieces`` into ``path`` and make it durable with one ``fsync``."""
    target = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        for piece in pieces:
            handle = os.open(piece.path, os.O_RDONLY)
            try:
                _copy_range(handle, target, piece.offset, piece.size)
            finally:
                os.close(handle)
        # The digest is taken from the parts, so the copy must be checked to be whole.
        written = os.fstat(target).st_size
        expected = sum(piece.size for piece in pieces)
        if written != expected:
            raise OSError(f"assembled {written} bytes of {expected}")
        os.fsync(target)
    finally:
        os.close(target)


def assemble(
    pieces: Sequence[Segment],
    path: Path,
    hashed: Sequence[Segment],
    update: Callable[[memoryview], None],
) -> None:
    """Join ``pieces`` into ``path`` while hashing ``hashed`` (the tail the chain lacks).

    The kernel copies (``copy_file_range``) while this thread hashes from the page cache;
    both release the GIL, so the wall time is the longer of the two, not their sum.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="dvbench-assemble") as pool:
        copied = pool.submit(concatenate, pieces, path)
        hash_segments(hashed, update)
        copied.result()
