"""Snapshot and batch files kept beside the transcript for the platform's replay.

Layout under the proof directory::

    files/snapshot-<step>.{params,opt_state,buffers}.bin   pre-state of <step>
    files/batch-<step>.u32                                 committed batch of <step>
    files/grad-<step>.bin                                  computed values of <step>

A state file is the raw bytes of its leaves (C order, little endian) concatenated in
the root record's schema order; it carries no header because its commitment *is* the
state root already in the transcript: a reader cuts it by the schema and recomputes the
root (:func:`read_state`); a gradient file is a state file of the step's computed values
(:mod:`zkdv.gradients`), cut by the root's ``schema.grad``. A batch file is ``rows`` and ``cols`` as two little-endian
uint64 followed by the uint32 words; its commitment is the step record's batch root.

Large files (snapshots) are written with direct I/O where the file system offers it. A
buffered write of a fresh 132 MiB file costs ~350 ms of CPU on a two-core VM (the kernel
allocates and fills a page-cache page per 4 KiB, and reclaims to make room), enough to
rival the training step it runs beside; through a page-aligned staging buffer and
``O_DIRECT`` the same file costs one ~20 ms memcpy and the disk does the rest. Where
direct I/O is refused (tmpfs, some overlay and network file systems) the write falls
back to a buffered one with the same bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from zkdv.merkle import LeafSpec, StateCommitment, commit_state

__all__ = [
    "FILES_DIR",
    "PROGRAM_FILES",
    "TREES",
    "batch_path",
    "gradient_path",
    "program_file",
    "read_batch",
    "read_state",
    "snapshot_path",
    "write_batch",
    "write_state",
]

FILES_DIR = "files"
TREES = ("params", "opt_state", "buffers")
#: The file name of the attested program per program kind (the root record's
#: ``program.kind``), in the proof directory; any other kind (``torch.export``) is
#: saved as :data:`PROGRAM_FALLBACK`. Read it through :func:`program_file`.
PROGRAM_FILES = {"jax.export": "program.jaxexport", "aot-inductor": "program.pt2"}
PROGRAM_FALLBACK = "program.bin"


def program_file(kind: str) -> str:
    """The proof directory's file name of the attested program of ``kind``."""
    return PROGRAM_FILES.get(kind, PROGRAM_FALLBACK)


def snapshot_path(proof_dir: str | os.PathLike[str], step: int, tree: str) -> Path:
    if tree not in TREES:
        raise ValueError(f"unknown state tree {tree!r}")
    return Path(proof_dir) / FILES_DIR / f"snapshot-{step:08d}.{tree}.bin"


def batch_path(proof_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(proof_dir) / FILES_DIR / f"batch-{step:08d}.u32"


def gradient_path(proof_dir: str | os.PathLike[str], step: int) -> Path:
    """The computed values (gradient and carried state) of ``step``."""
    return Path(proof_dir) / FILES_DIR / f"grad-{step:08d}.bin"


# Files at least this large go through direct I/O; below it a buffered write is cheaper
# than the staging copy and the wait for the disk (a batch file is a few hundred KiB).
DIRECT_MIN_BYTES = 1 << 20
_BLOCK = 4096  # alignment of buffer, length and offset that every Linux file system accepts
_STAGE_BYTES = 8 << 20
_stages = threading.local()


def _stage() -> mmap.mmap:
    """This thread's page-aligned staging buffer (an anonymous mapping is page-aligned)."""
    stage: mmap.mmap | None = getattr(_stages, "buffer", None)
    if stage is None:
        stage = _stages.buffer = mmap.mmap(-1, _STAGE_BYTES)
    return stage


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _write_direct(path: Path, chunks: Sequence[memoryview], total: int) -> bool:
    """Write ``chunks`` to ``path`` with ``O_DIRECT``; False if the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    stage = _stage()
    staged = memoryview(stage)
    try:
        fill = 0
        for chunk in chunks:
            position = 0
            while position < len(chunk):
                n = min(len(chunk) - position, _STAGE_BYTES - fill)
                staged[fill : fill + n] = chunk[position : position + n]
                fill += n
                position += n
                if fill == _STAGE_BYTES:
                    _write_all(fd, staged)
                    fill = 0
        if fill:
            # The last block is padded to the alignment and the file cut back to size.
            padded = -(-fill // _BLOCK) * _BLOCK
            staged[fill:padded] = bytes(padded - fill)
            _write_all(fd, staged[:padded])
        os.ftruncate(fd, total)
    except OSError as error:
        if error.errno == errno.EINVAL:  # accepted at open, refused at write (some FUSE)
            return False
        raise
    finally:
        staged.release()
        os.close(fd)
    return True


def _atomic_write(
    path: Path, chunks: Sequence[bytes | memoryview], *, direct: bool | None = None
) -> None:
    """Write ``chunks`` to ``path`` through a temporary file and an atomic rename.

    ``direct`` forces (True) or forbids (False) the attempt at direct I/O; by default it
    is tried for files of at least :data:`DIRECT_MIN_BYTES`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    total = sum(len(view) for view in views)
    if direct is None:
        direct = total >= DIRECT_MIN_BYTES
    if not (direct and _write_direct(temporary, views, total)):
        with open(temporary, "wb") as handle:
            for view in views:
                handle.write(view)
    os.replace(temporary, path)


def write_state(
    path: Path, leaves: Sequence[tuple[str, np.ndarray]], *, direct: bool | None = None
) -> int:
    """Write one state tree; returns its size in bytes. Written atomically.

    ``direct``: see :func:`_atomic_write` (None tries direct I/O for large files).
    """
    views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for _, a in leaves]
    _atomic_write(path, views, direct=direct)
    return sum(len(v) for v in views)


def read_state(
    path: Path, specs: Sequence[LeafSpec], chunk_bytes: int
) -> tuple[list[tuple[str, np.ndarray]], StateCommitment]:
    """Read a state file by its schema and recompute its commitment.

    Raises:
        ValueError: the file's size does not match the schema.
    """
    data = np.fromfile(path, dtype=np.uint8) if path.stat().st_size else np.zeros(0, np.uint8)
    expected = sum(spec.nbytes for spec in specs)
    if data.size != expected:
        raise ValueError(f"{path.name} holds {data.size} bytes; the schema needs {expected}")
    leaves = []
    offset = 0
    for spec in specs:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        raw = data[offset : offset + spec.nbytes]
        leaves.append((spec.path, raw.view(dtype).reshape(spec.shape)))
        offset += spec.nbytes
    return leaves, commit_state(leaves, chunk_bytes)


def write_batch(path: Path, batch: np.ndarray) -> None:
    rows, cols = batch.shape
    _atomic_write(
        path,
        [
            struct.pack("<QQ", rows, cols),
            np.ascontiguousarray(batch, dtype="<u4").reshape(-1).view(np.uint8).data,
        ],
    )


def read_batch(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    if len(raw) < 16:
        raise ValueError(f"{path.name} is too short to be a batch file")
    rows, cols = struct.unpack("<QQ", raw[:16])
    if len(raw) != 16 + rows * cols * 4:
        raise ValueError(
            f"{path.name} declares {rows}x{cols} words but holds {len(raw) - 16} bytes"
        )
    return np.frombuffer(raw, dtype="<u4", offset=16).reshape(rows, cols)
