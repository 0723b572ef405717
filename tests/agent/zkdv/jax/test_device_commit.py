"""Device kernels of the JAX frontend: chunk roots and probes, bit for bit the host's.

``zkdv.jax.device_merkle`` hashes on the device (here XLA:CPU) what ``zkdv.merkle``
hashes on the host, and ``zkdv.jax.device_probes`` projects what ``ProbeSet.project``
projects. Each distinct layout is one XLA compile (a few seconds), so the tests put many
boundary cases into one state rather than one compile per case.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zkdv.device_merkle import HashPlan, key_words, roots_to_bytes, state_commitment
from zkdv.hashing import Domain
from zkdv.jax.device_merkle import (
    BLOCKWISE,
    COMPACT,
    FUSED,
    KERNEL,
    Schedule,
    chunk_roots,
    default_schedule,
    supported,
)
from zkdv.jax.device_probes import DeviceProbes
from zkdv.merkle import LeafSpec, commit_state
from zkdv.probes import ProbeSet

# Byte lengths around block (64), BLAKE3 chunk (1024) and Merkle chunk boundaries.
LENGTHS = (0, 1, 3, 63, 64, 65, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 9000)
DTYPES = (
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.bool_,
)


def _array(rng: np.random.Generator, dtype: Any, count: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(count) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    return (rng.standard_normal(count) * 100).astype(dtype)


def _state(seed: int) -> list[tuple[str, np.ndarray]]:
    """Every committed dtype at every boundary length (rounded down to whole items)."""
    rng = np.random.default_rng(seed)
    leaves = []
    for i, dtype in enumerate(DTYPES):
        if not supported(dtype, jax.default_backend()):
            continue  # a TPU's float64 is not IEEE: those leaves are hashed on the host
        for j, length in enumerate(LENGTHS):
            if (i + j) % 3:  # a third of the grid keeps the one compile small
                continue
            count = length // np.dtype(dtype).itemsize
            leaves.append((f"{np.dtype(dtype).name}/{length}", _array(rng, dtype, count)))
    leaves.append(("matrix", rng.standard_normal((40, 33)).astype(np.float32)))
    leaves.append(("step", np.array(7, np.int32)))
    return leaves


def _device_roots(
    leaves: list[tuple[str, np.ndarray]], chunk_bytes: int, schedule: Schedule = COMPACT
) -> list[bytes]:
    arrays = [jnp.asarray(a) for _, a in leaves]
    return roots_to_bytes(jax.device_get(chunk_roots(arrays, chunk_bytes, schedule=schedule)))


@pytest.mark.parametrize(
    ("chunk_bytes", "schedule"),
    [
        (64, COMPACT),
        pytest.param(1024, COMPACT, marks=pytest.mark.long),
        pytest.param(4096, COMPACT, marks=pytest.mark.long),
        pytest.param(4096, Schedule(False, True), marks=pytest.mark.long),
        (4096, BLOCKWISE),  # the accelerators' default: every dtype, bulk, looped levels
        (4096, KERNEL),  # the TPU's: the bulk by the Pallas kernels (interpreted here)
        pytest.param(1024, KERNEL, marks=pytest.mark.long),  # one full chunk a message
    ],
)
def test_roots_match_the_host_for_every_dtype_and_length(
    chunk_bytes: int, schedule: Schedule
) -> None:
    with jax.enable_x64(True):
        leaves = _state(chunk_bytes)
        expected = commit_state(leaves, chunk_bytes)
        roots = _device_roots(leaves, chunk_bytes, schedule)
    assert roots == list(expected.chunk_roots)
    assert state_commitment(expected.specs, roots) == expected


def test_roots_match_with_the_default_chunk_size() -> None:
    # 1 MiB chunks: bulk BLAKE3 chunks, ten levels of perfect subtrees, one-byte tails,
    # and a partial last chunk.
    rng = np.random.default_rng(1)
    leaves = [
        ("big", rng.standard_normal((5 << 17) + 5).astype(np.float32)),
        ("exact", rng.standard_normal(1 << 18).astype(np.float32)),
        ("small", rng.standard_normal(300).astype(ml_dtypes.bfloat16)),
    ]
    expected = list(commit_state(leaves, 1 << 20).chunk_roots)
    assert _device_roots(leaves, 1 << 20) == expected
    # The TPU's schedule: ten levels of parent kernels, two messages in the bulk batch.
    assert _device_roots(leaves, 1 << 20, KERNEL) == expected


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.binary(min_size=4003, max_size=4003), st.binary(min_size=17, max_size=17))
def test_any_bytes_hash_like_the_host(first: bytes, second: bytes) -> None:
    # One layout (compiled once), any contents.
    leaves = [
        ("a", np.frombuffer(first, np.uint8)),
        ("b", np.frombuffer(second, np.int8)),
        ("c", np.frombuffer(first[:4000], np.float32).reshape(40, 25)),
    ]
    assert _device_roots(leaves, 1024) == list(commit_state(leaves, 1024).chunk_roots)


@pytest.mark.slow
@pytest.mark.long  # FUSED is no backend's default; BLOCKWISE and KERNEL run by default
def test_the_fused_schedule_gives_the_same_roots() -> None:
    # FUSED (unrolled rounds and blocks) was the accelerator default; XLA:CPU compiles it
    # slowly (~20 s here), so this checks it on the smallest layout that reaches every
    # part of the program: odd chunks, a Merkle level, a carried node.
    leaves = [("a", np.arange(25, dtype=np.float32)), ("b", np.arange(3, dtype=np.int8))]
    assert _device_roots(leaves, 64, FUSED) == list(commit_state(leaves, 64).chunk_roots)


@pytest.mark.long  # its edge cases, interpreted; the KERNEL roots above run the kernel by default
def test_the_bulk_kernel_matches_the_reference_at_every_batch_size() -> None:
    """The Pallas kernels alone (interpreted), against the numpy reference, over several
    leaves at once: leaves that fill whole kernel invocations and ones that are padded,
    one chunk a message and many (the counter wraps at each message; the subtree's
    levels in the kernel and above it), messages longer than an invocation, and each
    message's last data word (its tail chunk)."""
    from zkdv.device_merkle import NumpyOps, _bulk_roots, _chunk_rows
    from zkdv.jax._blake3_kernel import BULK_ROWS, bulk_roots

    rng = np.random.default_rng(7)
    key = key_words(Domain.LEAF)
    size = BULK_ROWS * 128
    for per, counts in [(1, [3]), (4, [5, 1]), (64, [2, 3]), (2, [size, 1]), (2 * size, [1])]:
        width = per * 256
        words = [
            rng.integers(0, 1 << 32, n * width + extra, dtype=np.uint64).astype(np.uint32)
            for n, extra in zip(counts, [5, 0, 9], strict=False)
        ]
        plan = HashPlan.build([w.size * 4 for w in words], per * 1024)
        matrix, _ = _chunk_rows(NumpyOps(), plan, words)
        with np.errstate(over="ignore"):
            want = _bulk_roots(NumpyOps(), plan, matrix, [np.uint32(k) for k in key])
        got, last = jax.jit(lambda w, c=counts, p=per: bulk_roots(w, c, key, p))(words)
        for word, (mine, reference) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_array_equal(np.asarray(mine), reference, err_msg=f"{per=} {word=}")
        ends = [w[width - 1 : n * width : width] for w, n in zip(words, counts, strict=True)]
        np.testing.assert_array_equal(np.asarray(last), np.concatenate(ends), err_msg=f"{per=}")


def test_the_odd_chunk_kernel_matches_the_reference() -> None:
    """Chunks of every length, counter and ROOT flag (a layout's odd batch: one-byte
    tails, short messages, the full and last chunks of partial Merkle chunks), by the
    Pallas kernel (interpreted) against the numpy reference's block-by-block batch."""
    from zkdv.device_merkle import NumpyOps, _chunk_batch
    from zkdv.jax._blake3_kernel import odd_chunks

    rng = np.random.default_rng(8)
    key = key_words(Domain.LEAF)
    plan = HashPlan.build([0, 1, 63, 64, 65, 1023, 1024, 4097, 9000, 8192, 2048 + 700], 4096)
    count = len(plan.odd_counter)
    assert set(plan.odd_length) >= {1, 64, 65, 1024} and plan.odd_root.any()
    matrix = rng.integers(0, 1 << 32, (count, 256), dtype=np.uint64).astype(np.uint32)
    block_len, flags, active = plan.odd_tables()

    def params(j: Any) -> tuple[Any, Any, Any, Any]:
        return plan.odd_counter, block_len[j], flags[j], active[j]

    ops = NumpyOps()
    with np.errstate(over="ignore"):
        want = _chunk_batch(ops, matrix, [np.uint32(k) for k in key], 16, params, count)
    tables = (plan.odd_counter, plan.odd_length, plan.odd_root)
    got = jax.jit(lambda m: odd_chunks(m, key, *tables))(matrix)
    for word, (mine, reference) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(np.asarray(mine), reference, err_msg=f"{word=}")


def test_the_accelerators_roots_program_lowers_for_tpu() -> None:
    """The TPU's chunk-roots program (:func:`default_schedule`), exported for TPU on a
    CPU: an operation the TPU's lowering (XLA's, or Mosaic's for the kernels) refuses,
    or a 64-bit type, fails here in CI rather than at a TPU run's first step."""
    schedule = default_schedule("tpu")
    assert schedule == KERNEL and default_schedule("gpu") == BLOCKWISE
    # A state over several chips: a Mosaic call is not partitioned, XLA's program is.
    assert default_schedule("tpu", devices=4) == BLOCKWISE
    assert default_schedule("cpu", devices=8) == COMPACT
    shapes = [((3, 1 << 18), jnp.float32), ((300,), jnp.bfloat16), ((), jnp.int32)]
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]  # type: ignore[no-untyped-call]

    def roots(leaves: list[Any]) -> Any:
        return chunk_roots(leaves, 1 << 20, schedule=schedule)

    exported = jax.export.export(jax.jit(roots), platforms=("tpu",))(specs)
    text = exported.mlir_module()
    assert not re.findall(r"[x<](?:f64|i64|ui64)>", text)
    assert exported.out_avals[0].shape == (3, 8)
    # The bulk is Mosaic kernels: the chunks' (with the first four levels of their
    # subtrees), one per level above those (1 MiB chunks: six more) and the odd chunks',
    # so their compressions are not in the XLA program.
    assert text.count("tpu_custom_call") == 8
    # Every rotation is an OR of two shifts: FUSED unrolls the blocks and the levels (2,235
    # ORs for this layout), BLOCKWISE loops over them (357), KERNEL leaves XLA the rest.
    fused = jax.export.export(
        jax.jit(lambda leaves: chunk_roots(leaves, 1 << 20, schedule=FUSED)), platforms=("tpu",)
    )(specs)
    assert text.count("stablehlo.or") * 5 < fused.mlir_module().count("stablehlo.or")


def test_unsupported_dtypes_are_reported() -> None:
    assert supported(np.float32) and supported(ml_dtypes.bfloat16) and supported(np.bool_)
    assert not supported(ml_dtypes.int4)
    assert not supported(np.complex64)
    # Measured on a TPU v5e: float64 leaves (x64) gave other roots on the device than on
    # the host (XLA keeps a TPU's float64 as two float32s); they go to the host there.
    assert supported(np.float64, "cpu") and not supported(np.float64, "tpu")
    assert supported(np.float32, "tpu") and supported(ml_dtypes.bfloat16, "tpu")


def _probe_leaves(rng: np.random.Generator) -> list[np.ndarray]:
    wide = rng.standard_normal((300, 257)) * np.exp2(rng.integers(-60, 60, (300, 257)))
    first = wide.astype(np.float32)
    first[3, 5] = np.inf
    first[12, :5] = np.nan
    first[11] = np.float32(1e-40)
    first[10] = 0.0
    return [
        first,
        rng.standard_normal(7).astype(np.float32),
        np.array(2.5, np.float32),
        rng.standard_normal((70, 33)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((65, 8)).astype(np.float16),
        np.zeros((5, 0), np.float32),
        rng.standard_normal((3, 1024)).astype(np.float64),
    ]


def test_device_probes_are_the_host_probes_bit_for_bit() -> None:
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        arrays = _probe_leaves(rng)
        specs = [LeafSpec.of(str(i), a) for i, a in enumerate(arrays)]
        probes = ProbeSet.create(specs, 0.05, b"seed" * 4)
        host = probes.project_all(arrays)
        device = DeviceProbes(probes)
        flat = jax.device_get(device([jnp.asarray(a) for a in arrays]))
    assert flat.dtype == np.float32 and flat.size == probes.floats
    for leaf, (want, got) in enumerate(zip(host, device.split(flat), strict=True)):
        assert got.shape == want.shape, leaf
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), leaf
