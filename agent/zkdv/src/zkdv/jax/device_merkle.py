"""``zkdv.merkle`` chunk roots computed by XLA on the device that holds the state.

:func:`chunk_roots` runs the algorithm of :mod:`zkdv.device_merkle` (BLAKE3 and the
RFC 6962 chunk tree) as ``jax.numpy`` uint32 code inside one jitted program, so the
only bytes that leave the device are 32 per leaf; :func:`zkdv.device_merkle.
state_commitment` finishes the state root on the host. The roots are bit-identical to
:func:`zkdv.merkle.commit_state` for every dtype JAX holds as whole bytes (floats of
8 to 64 bits, integers, bool).

Compression runs block by block over all chunks of the state at once. A
:class:`Schedule` says how the program is laid out, never what it computes: BLAKE3's
rounds and blocks unrolled (large fused kernels that keep the state in registers) or as
``lax.fori_loop`` s (a small program), the bulk subtrees' levels at their exact sizes or
as one fixed-shape loop, and on a TPU every BLAKE3 chunk by the Pallas kernels of
:mod:`zkdv.jax._blake3_kernel`. Every schedule gives the same bits;
:func:`default_schedule` picks per backend. The compilers decide: XLA:CPU takes minutes
over the unrolled form, and the TPU's took 111 and 131 s over :data:`FUSED` for the two
layouts of a 135M-parameter model, against 41 s for the model's whole training step,
then ran :data:`BLOCKWISE` at 5 GB/s; :data:`KERNEL`'s kernels compile in under a
second and hash at 250 GB/s (``docs/reliability.md`` section 10).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zkdv.device_merkle import HashPlan
from zkdv.device_merkle import chunk_roots as _chunk_roots

__all__ = [
    "BLOCKWISE",
    "COMPACT",
    "FUSED",
    "KERNEL",
    "JaxOps",
    "Schedule",
    "chunk_roots",
    "default_schedule",
    "leaf_words",
    "supported",
]


def supported(dtype: Any, platform: str | None = None) -> bool:
    """Whether leaves of ``dtype`` can be hashed on the device (whole-byte dtypes).

    ``platform`` is the backend holding the leaf: a TPU has no IEEE float64 (XLA keeps
    a float64 there as a pair of float32s), so its float64 leaves have no device bytes
    to hash (measured on a v5e: their roots differ from the host's) and go to the host.
    """
    dtype = np.dtype(dtype)
    if platform == "tpu" and dtype == np.float64:
        return False
    # ml_dtypes' types (bfloat16, float8_*) are numpy kind "V"; complex, strings,
    # objects and datetimes are not state.
    if dtype.itemsize not in (1, 2, 4, 8) or dtype.kind in "cOSUMm":
        return False
    # Sub-byte types (int4, float4_e2m1fn, ...) may be packed on the device.
    return not dtype.name.startswith(_SUB_BYTE)


# Full names up to the underscore: "float6" alone would also match "float64".
_SUB_BYTE = ("int2", "uint2", "int4", "uint4", "float4_", "float6_")


class Schedule(NamedTuple):
    """How the hashing program is laid out (the result is the same for every schedule).

    Attributes:
        unroll: unroll BLAKE3's 7 rounds (and, unless ``unroll_blocks`` says otherwise,
            each chunk's 16 blocks).
        exact_levels: hash each level of the trees at its exact size (one program per
            level) rather than in one fixed-shape loop, which hashes the widest level's
            pairs at every level (the bulk subtrees: about ``log2(chunk_bytes / 1024) /
            2`` times the parent-node work; the partial Merkle chunks' trees more).
        unroll_blocks: unroll the 16 blocks of a chunk; None: as ``unroll``.
        kernel: the bulk (every full chunk and its message's subtree) by the Pallas
            kernels of ``zkdv.jax._blake3_kernel`` (Mosaic on a TPU, Pallas's
            interpreter elsewhere); the other fields then lay out the rest.
    """

    unroll: bool
    exact_levels: bool
    unroll_blocks: bool | None = None
    kernel: bool = False


COMPACT = Schedule(unroll=False, exact_levels=False)
FUSED = Schedule(unroll=True, exact_levels=True)
# One block's compression unrolled (one fused kernel over every chunk of the state), the
# blocks and the levels as loops: one compression in the program where FUSED has about
# forty, so a fraction of its compile, at the price of the chaining values' round trip
# to memory between blocks (32 bytes a chunk written and read back beside each block's
# 64 bytes of message).
BLOCKWISE = Schedule(unroll=True, exact_levels=False, unroll_blocks=False)
# The bulk (all but a few compressions per Merkle chunk) by Pallas kernels, the rest
# with rounds and blocks as loops: on a v5e the kernels hashed 217 GB/s where
# BLOCKWISE's whole pipeline did 12, and compiled in under a second each. The trees'
# levels at their exact sizes: as one loop at the widest level's size, the partial
# Merkle chunks' trees took 25 of the 63 ms the optimizer state's commitment took.
KERNEL = Schedule(unroll=False, exact_levels=True, kernel=True)


def default_schedule(backend: str | None = None, devices: int = 1) -> Schedule:
    """:data:`COMPACT` on CPU (compile time); :data:`KERNEL` for a state on one TPU chip
    (Pallas's Mosaic kernels are the TPU's, and a Mosaic call is not partitioned across
    chips); :data:`BLOCKWISE` on any other accelerator or a state over several chips.

    Args:
        backend: the platform holding the state (``jax.default_backend()`` when None).
        devices: how many devices hold it.
    """
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return COMPACT
    return KERNEL if backend == "tpu" and devices == 1 else BLOCKWISE


class JaxOps:
    """:class:`zkdv.device_merkle.Ops` over ``jax.numpy`` uint32 arrays."""

    def __init__(
        self,
        *,
        unroll: bool,
        exact_levels: bool | None = None,
        unroll_blocks: bool | None = None,
        kernel: bool = False,
    ) -> None:
        self.unroll = unroll
        self.exact_levels = unroll if exact_levels is None else exact_levels
        self.unroll_blocks = unroll if unroll_blocks is None else unroll_blocks
        self.kernel = kernel

    def bulk_roots(self, plan: HashPlan, words: Sequence[Any], key: Sequence[int]) -> Any:
        if not self.kernel:
            return None
        from zkdv.jax._blake3_kernel import bulk_roots  # Pallas only where it is asked for

        full = [(w, leaf.full) for leaf, w in zip(plan.leaves, words, strict=True) if leaf.full]
        return bulk_roots([w for w, _ in full], [n for _, n in full], key, plan.per_message)

    def odd_chunks(self, matrix: Any, key: Sequence[int], plan: HashPlan) -> list[Any] | None:
        if not self.kernel:
            return None
        from zkdv.jax._blake3_kernel import odd_chunks

        return odd_chunks(matrix, key, plan.odd_counter, plan.odd_length, plan.odd_root)

    def const(self, value: int) -> Any:
        return jnp.uint32(value)

    def full(self, count: int, value: int) -> Any:
        return jnp.full((count,), value, jnp.uint32)

    def array(self, values: np.ndarray) -> Any:
        return jnp.asarray(values)

    def shr(self, x: Any, n: int) -> Any:
        return lax.shift_right_logical(x, jnp.uint32(n))

    def shl(self, x: Any, n: int) -> Any:
        return lax.shift_left(x, jnp.uint32(n))

    def rotr(self, x: Any, n: int) -> Any:
        return lax.shift_right_logical(x, jnp.uint32(n)) | lax.shift_left(x, jnp.uint32(32 - n))

    def batch_shape(self, items: Sequence[Any]) -> tuple[int, ...]:
        return tuple(jnp.broadcast_shapes(*(jnp.shape(x) for x in items)))

    def stack(self, items: Sequence[Any], shape: tuple[int, ...]) -> Any:
        return jnp.stack([jnp.broadcast_to(jnp.asarray(x, jnp.uint32), shape) for x in items])

    def unstack(self, x: Any) -> list[Any]:
        return [x[i] for i in range(x.shape[0])]

    def rows(self, x: Any, index: Sequence[int]) -> Any:
        return jnp.stack([x[i] for i in index])

    def roll(self, x: Any, shift: int) -> Any:
        return jnp.concatenate([x[shift:], x[:shift]])

    def concat(self, parts: Sequence[Any], axis: int = 0) -> Any:
        return jnp.concatenate(list(parts), axis=axis)

    def take(self, x: Any, index: np.ndarray) -> Any:
        return jnp.take(x, jnp.asarray(index), axis=0, indices_are_sorted=False, mode="clip")

    def select(self, mask: Any, a: Any, b: Any) -> Any:
        return jnp.where(mask, a, b)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return jnp.zeros(shape, jnp.uint32)

    def pad_to(self, x: Any, width: int) -> Any:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]
        return jnp.pad(x, pad)

    def column(self, x: Any, index: Any) -> Any:
        if isinstance(index, int):
            return x[:, index]
        return lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)

    def row(self, table: Any, index: Any) -> Any:
        if isinstance(index, int):
            return table[index]
        return lax.dynamic_index_in_dim(table, index, axis=0, keepdims=False)

    def flag(self, condition: Any, value: int) -> Any:
        if isinstance(condition, bool):
            return jnp.uint32(value if condition else 0)
        return jnp.where(condition, jnp.uint32(value), jnp.uint32(0))

    def fori(
        self, count: int, body: Callable[[Any, list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]:
        if self.unroll_blocks:
            state = init
            for j in range(count):
                state = body(j, state)
            return state
        return list(lax.fori_loop(0, count, lambda j, s: tuple(body(j, list(s))), tuple(init)))

    def loop(
        self, count: int, body: Callable[[Any, list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]:
        return list(lax.fori_loop(0, count, lambda j, s: tuple(body(j, list(s))), tuple(init)))

    def rounds(
        self, count: int, body: Callable[[list[Any]], list[Any]], init: list[Any]
    ) -> list[Any]:
        if self.unroll:
            state = init
            for _ in range(count):
                state = body(state)
            return state
        return list(lax.fori_loop(0, count, lambda _, s: tuple(body(list(s))), tuple(init)))


def leaf_words(leaf: Any) -> Any:
    """A leaf's bytes (C order, little endian) as 1-D uint32 words, the last zero-padded."""
    x = jnp.ravel(leaf)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    narrow = jnp.uint16 if size == 2 else jnp.uint8
    per = 4 // size
    x = lax.bitcast_convert_type(x, narrow)
    x = jnp.pad(x, (0, -x.size % per))
    return lax.bitcast_convert_type(x.reshape(-1, per), jnp.uint32)


def _roots(plan: HashPlan, schedule: Schedule, leaves: Sequence[Any]) -> Any:
    words = [leaf_words(leaf) for leaf in leaves]
    ops = JaxOps(
        unroll=schedule.unroll,
        exact_levels=schedule.exact_levels,
        unroll_blocks=schedule.unroll_blocks,
        kernel=schedule.kernel,
    )
    roots = _chunk_roots(ops, plan, words)
    return jnp.stack(roots, axis=1)


@functools.lru_cache(maxsize=64)
def _program(nbytes: tuple[int, ...], chunk_bytes: int, schedule: Schedule) -> Any:
    plan = HashPlan.build(nbytes, chunk_bytes)
    return jax.jit(functools.partial(_roots, plan, schedule))


def _nbytes(leaf: Any) -> int:
    return int(np.prod(jnp.shape(leaf), dtype=np.int64)) * np.dtype(jnp.result_type(leaf)).itemsize


def chunk_roots(
    leaves: Sequence[Any], chunk_bytes: int, *, schedule: Schedule | None = None
) -> jax.Array:
    """The chunk root of every leaf as a ``(len(leaves), 8)`` uint32 device array.

    Dispatches asynchronously (one cached jitted program per layout); read the result
    with :func:`jax.device_get` and :func:`zkdv.device_merkle.roots_to_bytes`.

    Args:
        leaves: the state's leaves in canonical order (JAX arrays on one device, or
            anything ``jnp.asarray`` accepts).
        chunk_bytes: the run's Merkle chunk size.
        schedule: the program's layout; :func:`default_schedule` when None.
    """
    if schedule is None:
        schedule = default_schedule()
    nbytes = tuple(_nbytes(leaf) for leaf in leaves)
    result: jax.Array = _program(nbytes, chunk_bytes, schedule)(list(leaves))
    return result
