"""The array form of BLAKE3 and the Merkle scheme (``zkdv.device_merkle``), on numpy.

The numpy reference runs the very algorithm the JAX and Torch device kernels run, so it
is checked here against the two independent implementations: the ``blake3`` package
(BLAKE3 itself, keyed, for every message length class) and ``zkdv.merkle`` (chunking,
the leaf prefix, the RFC 6962 tree, tensor digests and the state root).
"""

from __future__ import annotations

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkdv import merkle
from zkdv.device_merkle import HashPlan, numpy_chunk_roots, state_commitment
from zkdv.hashing import Domain, key_for

# Message lengths around every BLAKE3 boundary: block (64), chunk (1024), parent levels.
LENGTHS = (0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 1023, 1024, 1025, 2047, 2048, 2049)
LENGTHS += (3072, 3073, 4095, 4096, 4097, 8191, 8193, 16384, 16385)


def _leaf_hash(data: bytes) -> bytes:
    return blake3.blake3(b"\x00" + data, key=key_for(Domain.LEAF)).digest()


@pytest.mark.parametrize("length", LENGTHS)
def test_one_chunk_root_is_keyed_blake3_of_the_prefixed_bytes(length: int) -> None:
    # A leaf shorter than its chunk is one Merkle chunk: its root is BLAKE3 itself, so
    # this checks the compression function, chunk flags and BLAKE3's tree for a
    # message of ``length + 1`` bytes against the blake3 package.
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    assert numpy_chunk_roots([data], 1 << 20) == [_leaf_hash(data.tobytes())]


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=20000))
def test_blake3_agrees_for_any_message(data: bytes) -> None:
    array = np.frombuffer(data, dtype=np.uint8)
    assert numpy_chunk_roots([array], 1 << 15) == [_leaf_hash(data)]


_DTYPES = ("float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


def _array(rng: np.random.Generator, dtype: str, size: int) -> np.ndarray:
    if dtype == "bool":
        return rng.random(size) < 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    return rng.standard_normal(size).astype(dtype)


@pytest.mark.parametrize("chunk_bytes", [64, 128, 1024, 2048, 4096])
def test_multi_leaf_states_match_commit_state(chunk_bytes: int) -> None:
    rng = np.random.default_rng(chunk_bytes)
    leaves = []
    for i, length in enumerate(LENGTHS):
        dtype = _DTYPES[i % len(_DTYPES)]
        size = length // np.dtype(dtype).itemsize
        leaves.append((f"leaf{i}", _array(rng, dtype, size)))
    leaves.append(("matrix", rng.standard_normal((33, 71)).astype(np.float32)))
    leaves.append(("scalar", np.array(3, dtype=np.int32)))
    expected = merkle.commit_state(leaves, chunk_bytes)
    roots = numpy_chunk_roots([a for _, a in leaves], chunk_bytes)
    assert roots == list(expected.chunk_roots)
    assert state_commitment(expected.specs, roots) == expected


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([64, 256, 1024, 2048, 8192]),
    st.lists(st.tuples(st.sampled_from(_DTYPES), st.integers(0, 9000)), min_size=0, max_size=6),
    st.integers(0, 2**32 - 1),
)
def test_any_layout_matches_commit_state(
    chunk_bytes: int, layout: list[tuple[str, int]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    leaves = [(f"l{i}", _array(rng, dtype, size)) for i, (dtype, size) in enumerate(layout)]
    expected = merkle.commit_state(leaves, chunk_bytes)
    assert numpy_chunk_roots([a for _, a in leaves], chunk_bytes) == list(expected.chunk_roots)


def test_plan_puts_every_full_chunk_in_the_bulk_batch() -> None:
    # 1 MiB chunks: a 3.5 MiB leaf is 3 full Merkle chunks of 1024 BLAKE3 chunks each
    # (bulk) plus a partial one; the odd batch holds 3 one-byte tails and the partial
    # chunk's 513 BLAKE3 chunks.
    plan = HashPlan.build([7 << 19, 0, 12], 1 << 20)
    assert plan.per_message == 1024
    assert plan.bulk_messages == 3
    assert len(plan.odd_counter) == 3 + 513 + 1 + 1
    assert list(plan.odd_length[:3]) == [1, 1, 1]
    with pytest.raises(ValueError, match="power of two"):
        HashPlan.build([4], 1000)
