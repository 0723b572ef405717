"""Snapshot and batch files: direct I/O writes the same bytes as a buffered write."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from zkdv import files
from zkdv.merkle import LeafSpec, commit_state

CHUNK = 1 << 20


def _leaves(sizes: list[int], seed: int = 0) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[str, np.ndarray]] = []
    for i, size in enumerate(sizes):
        dtype = (np.float32, np.int8, np.float64)[i % 3]
        out.append((f"leaf{i}", rng.standard_normal(size).astype(dtype)))
    return out


# Leaf sizes (elements) chosen so that file offsets fall on and off the 4 KiB alignment,
# totals straddle the 8 MiB staging buffer, and the last block is partial or exact.
CASES = [
    [3],
    [1024],
    [262_144, 7, 1_048_576],
    [2_097_152 + 5, 13, 2_097_152],  # > 8 MiB staging: several flushes
    [2_097_152, 0, 1],
]


@pytest.mark.parametrize("sizes", CASES)
def test_direct_and_buffered_files_are_identical(tmp_path: Path, sizes: list[int]) -> None:
    leaves = _leaves(sizes)
    direct = tmp_path / "direct.bin"
    buffered = tmp_path / "buffered.bin"
    n_direct = files.write_state(direct, leaves, direct=True)
    n_buffered = files.write_state(buffered, leaves, direct=False)
    expected = sum(a.nbytes for _, a in leaves)
    assert n_direct == n_buffered == expected
    assert direct.stat().st_size == expected
    assert direct.read_bytes() == buffered.read_bytes()
    assert not list(tmp_path.glob("*.partial"))
    specs = [LeafSpec.of(path, array) for path, array in leaves]
    read, commitment = files.read_state(direct, specs, CHUNK)
    assert commitment.root == commit_state(leaves, CHUNK).root
    for (_, want), (_, got) in zip(leaves, read, strict=True):
        np.testing.assert_array_equal(got, want)


def test_large_files_take_the_direct_path_where_the_file_system_allows(tmp_path: Path) -> None:
    leaves = _leaves([files.DIRECT_MIN_BYTES // 4 + 3])
    views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for _, a in leaves]
    target = tmp_path / "probe.bin"
    if not files._write_direct(target, views, sum(len(v) for v in views)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT; the buffered fallback is what runs here")
    assert target.read_bytes() == b"".join(bytes(v) for v in views)


def test_a_file_system_without_direct_io_falls_back_to_buffered(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    leaves = _leaves([files.DIRECT_MIN_BYTES // 4 + 11])
    target = shm / f"zkdv-files-test-{os.getpid()}.bin"
    try:
        files.write_state(target, leaves, direct=True)
        files.write_state(tmp_path / "ref.bin", leaves, direct=False)
        assert target.read_bytes() == (tmp_path / "ref.bin").read_bytes()
    finally:
        target.unlink(missing_ok=True)


def test_overwriting_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    files.write_state(path, _leaves([3_000_000]), direct=True)
    smaller = _leaves([1_000_001], seed=1)
    files.write_state(path, smaller, direct=True)
    assert path.read_bytes() == smaller[0][1].tobytes()
