"""Snapshot and batch files kept beside the transcript for the platform's replay.

Layout under the proof directory::

    files/snapshot-<step>.{params,opt_state,buffers}.bin   pre-state of <step>
    files/batch-<step>.u32                                 committed batch of <step>

A state file is the raw bytes of its leaves (C order, little endian) concatenated in
the root record's schema order; it carries no header because its commitment *is* the
state root already in the transcript: a reader cuts it by the schema and recomputes the
root (:func:`read_state`). A batch file is ``rows`` and ``cols`` as two little-endian
uint64 followed by the uint32 words; its commitment is the step record's batch root.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from zkdv.merkle import LeafSpec, StateCommitment, commit_state

__all__ = [
    "FILES_DIR",
    "batch_path",
    "read_batch",
    "read_state",
    "snapshot_path",
    "write_batch",
    "write_state",
]

FILES_DIR = "files"
TREES = ("params", "opt_state", "buffers")


def snapshot_path(proof_dir: str | os.PathLike[str], step: int, tree: str) -> Path:
    if tree not in TREES:
        raise ValueError(f"unknown state tree {tree!r}")
    return Path(proof_dir) / FILES_DIR / f"snapshot-{step:08d}.{tree}.bin"


def batch_path(proof_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(proof_dir) / FILES_DIR / f"batch-{step:08d}.u32"


def _atomic_write(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    with open(temporary, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
    os.replace(temporary, path)


def write_state(path: Path, leaves: Sequence[tuple[str, np.ndarray]]) -> int:
    """Write one state tree; returns its size in bytes. Written atomically."""
    views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for _, a in leaves]
    _atomic_write(path, views)
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
