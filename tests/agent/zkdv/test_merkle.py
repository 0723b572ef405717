"""Chunked Merkle commitments: roots bind every byte; openings verify; forgeries fail."""

from __future__ import annotations

import dataclasses
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkdv import merkle
from zkdv.hashing import Domain, hash_bytes

CHUNK = 256


def _state(seed: int = 0) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        ("dense/kernel", rng.standard_normal((37, 19)).astype(np.float32)),
        ("dense/bias", rng.standard_normal(19).astype(np.float32)),
        ("step", np.array(7, dtype=np.int32)),
        ("half", rng.standard_normal((5, 9)).astype(np.float16)),
    ]


def test_parallel_and_serial_hashing_agree() -> None:
    leaves = _state()
    assert (
        merkle.commit_state(leaves, CHUNK).root
        == merkle.commit_state(leaves, CHUNK, parallel=False).root
    )


def _root_by_definition(leaves: list[tuple[str, np.ndarray]], chunk: int) -> bytes:
    """The state root as the module docstring defines it, from the hash function alone."""

    def tree(hashes: list[bytes]) -> bytes:  # RFC 6962's MTH over already-hashed leaves
        if len(hashes) == 1:
            return hashes[0]
        split = 1 << ((len(hashes) - 1).bit_length() - 1)
        return hash_bytes(Domain.NODE, b"\x01", tree(hashes[:split]), tree(hashes[split:]))

    digests = []
    for path, array in leaves:
        raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        chunks = [raw[i : i + chunk] for i in range(0, len(raw), chunk)] or [b""]
        root = tree([hash_bytes(Domain.LEAF, b"\x00", part) for part in chunks])
        header = cbor2.dumps([path, array.dtype.name, list(array.shape)], canonical=True)
        digests.append(hash_bytes(Domain.TENSOR, header, root))
    count = struct.pack("<Q", len(leaves))
    return hash_bytes(Domain.STATE, count, tree(digests))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("chunk", [CHUNK, 1 << 16])
def test_the_root_is_the_documented_tree_of_every_byte(
    parallel: bool, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if parallel:  # the pool's path, which only states above a few MiB take otherwise
        monkeypatch.setattr(merkle, "_PARALLEL_MIN_BYTES", 0)
    rng = np.random.default_rng(3)
    leaves = [
        *_state(),
        ("many/chunks", rng.standard_normal((9, 40)).astype(np.float32)),  # 1,440 bytes
        ("empty", np.zeros((0, 4), np.float32)),
        ("transposed", rng.standard_normal((6, 7)).astype(np.float32).T),
        ("big/endian", rng.standard_normal(70).astype(">f4")),
        # Leaves and chunks above the size whose first bytes are hashed from a copy.
        ("wide", rng.standard_normal((3, 5000)).astype(np.float32)),  # 60,000 bytes
        ("long", rng.standard_normal(50_000).astype(np.float32)),  # 200,000 bytes
    ]
    commitment = merkle.commit_state(leaves, chunk, parallel=parallel)
    assert commitment.root == _root_by_definition(leaves, chunk)


# Around the sizes where leaf_hash copies the prefix and the first bytes into one block.
_EDGES = sorted(
    {
        size + offset
        for size in (0, merkle._HEAD_MIN_BYTES, merkle._HEAD_BYTES, 1024, 1 << 16)
        for offset in (-2, -1, 0, 1, 2)
        if size + offset >= 0
    }
    | {(1 << 20) + 17}
)


def test_leaf_hashes_are_the_definition_at_every_edge() -> None:
    rng = np.random.default_rng(4)
    for size in _EDGES:
        data = rng.bytes(size)
        expected = hash_bytes(Domain.LEAF, b"\x00", data)
        assert merkle.leaf_hash(data) == expected, size
        assert merkle.leaf_hash(memoryview(data)) == expected, size
        words = np.frombuffer(data[: size - size % 4], dtype=np.float32)
        assert merkle.leaf_hash(merkle._as_bytes(words)) == hash_bytes(
            Domain.LEAF, b"\x00", words.tobytes()
        ), size


def test_leaf_hashes_on_many_threads_at_once() -> None:
    # Each thread copies into its own block: hashes running side by side on the pool
    # must not see each other's bytes.
    rng = np.random.default_rng(5)
    inputs = [rng.bytes(int(size)) for size in rng.integers(2048, 70_000, 16)]
    expected = [hash_bytes(Domain.LEAF, b"\x00", data) for data in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(20):
            assert list(pool.map(merkle.leaf_hash, inputs)) == expected


def test_a_started_commitment_leaves_the_caller_free_while_the_pool_hashes() -> None:
    # The commit stage starts hashing a step's state and runs its probes and records
    # beside it: start_commit must return while every hashing thread is still busy.
    rng = np.random.default_rng(9)
    large = [
        ("w", rng.standard_normal((1024, 1100)).astype(np.float32)),  # above the pool's 4 MiB
        ("b", rng.standard_normal(7).astype(np.float32)),
    ]
    expected = merkle.commit_state(large, 1 << 16, parallel=False)
    pool = merkle._pool()
    hold = threading.Event()
    busy = [pool.submit(hold.wait) for _ in range(pool._max_workers)]
    calls: list[merkle.PendingCommitment] = []
    caller = threading.Thread(target=lambda: calls.append(merkle.start_commit(large, 1 << 16)))
    caller.start()
    caller.join(timeout=30)
    returned = not caller.is_alive()
    hold.set()  # the pool is free again whatever happened
    caller.join()
    assert returned, "start_commit waited for the hashing pool"
    assert all(future.result() for future in busy)
    (started,) = calls
    assert started.result() == expected
    assert started.result() is started.result()  # finished once
    started.wait()
    small = merkle.start_commit(_state(), CHUNK)  # below the threshold: hashed in the call
    assert small.result() == merkle.commit_state(_state(), CHUNK, parallel=False)


def test_every_byte_is_bound() -> None:
    leaves = _state()
    root = merkle.commit_state(leaves, CHUNK).root
    for index, (path, array) in enumerate(leaves):
        raw = bytearray(array.tobytes())
        for position in (0, len(raw) // 2, len(raw) - 1):
            flipped = bytearray(raw)
            flipped[position] ^= 1
            changed = list(leaves)
            changed[index] = (
                path,
                np.frombuffer(bytes(flipped), dtype=array.dtype).reshape(array.shape),
            )
            assert merkle.commit_state(changed, CHUNK).root != root, (path, position)


def test_path_dtype_and_shape_are_bound() -> None:
    leaves = _state()
    root = merkle.commit_state(leaves, CHUNK).root
    renamed = [("other", leaves[0][1]), *leaves[1:]]
    reshaped = [(leaves[0][0], leaves[0][1].reshape(19, 37)), *leaves[1:]]
    retyped = [(leaves[0][0], leaves[0][1].view(np.int32)), *leaves[1:]]
    for variant in (
        renamed,
        reshaped,
        retyped,
        leaves[:-1],
        [*leaves, ("x", np.zeros(0, np.float32))],
    ):
        assert merkle.commit_state(variant, CHUNK).root != root


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=37 * 19 + 19 + 1 + 45 - 1))
def test_openings_verify_and_carry_the_value(flat_index: int) -> None:
    leaves = _state()
    root = merkle.commit_state(leaves, CHUNK).root
    opening = merkle.open_coordinate(leaves, flat_index, CHUNK)
    assert merkle.verify_opening(root, opening)
    flat = np.concatenate([a.reshape(-1).astype(np.float64) for _, a in leaves])
    assert opening.value() == pytest.approx(flat[flat_index])
    # An opening survives a CBOR round trip (how it travels to a verifier).
    assert merkle.verify_opening(root, merkle.CoordinateOpening.from_dict(opening.to_dict()))


@pytest.mark.parametrize(
    "forge",
    [
        lambda o: dataclasses.replace(
            o,
            chunk=dataclasses.replace(
                o.chunk, chunk=bytes([o.chunk.chunk[0] ^ 1]) + o.chunk.chunk[1:]
            ),
        ),
        lambda o: dataclasses.replace(
            o, chunk=dataclasses.replace(o.chunk, chunk_index=o.chunk.chunk_index + 1)
        ),
        lambda o: dataclasses.replace(o, element=o.element + 1),
        lambda o: dataclasses.replace(o, leaf_index=(o.leaf_index + 1) % o.leaf_count),
        lambda o: dataclasses.replace(o, spec=dataclasses.replace(o.spec, dtype="int32")),
        lambda o: dataclasses.replace(o, tensor_path=o.tensor_path[:-1]),
        lambda o: dataclasses.replace(o, tensor_path=(b"\x00" * 32, *o.tensor_path[1:])),
        lambda o: dataclasses.replace(
            o, chunk=dataclasses.replace(o.chunk, chunk_path=(*o.chunk.chunk_path, b"\x00" * 32))
        ),
        lambda o: dataclasses.replace(o, leaf_count=o.leaf_count + 1),
    ],
)
def test_forged_openings_are_rejected(forge) -> None:  # type: ignore[no-untyped-def]
    leaves = _state()
    root = merkle.commit_state(leaves, CHUNK).root
    specs = merkle.commit_state(leaves, CHUNK).specs
    opening = merkle.open_coordinate(leaves, 300, CHUNK)
    assert merkle.verify_opening(root, opening, specs=specs)
    assert not merkle.verify_opening(root, forge(opening), specs=specs)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=70), st.data())
def test_inclusion_paths_for_every_tree_size(size: int, data: st.DataObject) -> None:
    leaves = [hash_bytes(Domain.LEAF, bytes([i % 256, i // 256])) for i in range(size)]
    root = merkle.merkle_root(leaves)
    index = data.draw(st.integers(min_value=0, max_value=size - 1))
    path = merkle.inclusion_path(leaves, index)
    assert merkle.verify_inclusion(leaves[index], index, size, path, root)
    assert (
        not merkle.verify_inclusion(leaves[index], (index + 1) % size, size, path, root)
        or size == 1
    )
    assert not merkle.verify_inclusion(b"\x01" * 32, index, size, path, root)


def test_tree_shape_is_rfc6962() -> None:
    # RFC 6962 section 2.1: MTH(D[0:5]) = node(MTH(D[0:4]), MTH(D[4:5])).
    h = [hash_bytes(Domain.LEAF, bytes([i])) for i in range(5)]
    node = merkle._node
    assert merkle.merkle_root(h) == node(node(node(h[0], h[1]), node(h[2], h[3])), h[4])
