"""PyTree helpers of the JAX frontend: leaf paths, coordinate selection, batch packing.

Everything here is traceable (usable inside ``jax.jit`` and ``jax.export``) unless its
name says ``host``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SHARED_WORDS",
    "BatchLayout",
    "PackedLeaf",
    "index",
    "leaf_paths",
    "selection_cast",
    "selection_dtype",
]

#: Largest input (in words) replicated into every row of a row-mode batch.
SHARED_WORDS = 64


def leaf_paths(tree: Any, prefix: str) -> list[str]:
    """Paths of ``tree``'s leaves in canonical (``jax.tree.leaves``) order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(path) for path, _ in flat]


def selection_dtype(leaves: Sequence[Any]) -> Any:
    """The float dtype :func:`index` returns for these leaves (float64 only if one is)."""
    wide = any(jnp.dtype(getattr(leaf, "dtype", jnp.float32)) == jnp.float64 for leaf in leaves)
    return jnp.float64 if wide else jnp.float32


def selection_cast(leaves: Sequence[Any]) -> Any:
    """The numpy type :func:`index` selects into for these leaves (host-side casts)."""
    return np.dtype(selection_dtype(leaves)).type


def index(tree: Any, flat_index: Any) -> jax.Array:
    """Select one coordinate of a PyTree by its flat index, without concatenating it.

    The flat index runs over every element of every leaf in canonical order
    (``jax.tree.leaves``; each leaf in C order), the same order as the transcript's
    schema and its sampled ``param_index`` / ``state_index``. The selection costs one
    scalar dynamic slice per leaf; no parameter-sized buffer is materialised.

    Inside ``proof.attest`` the index is a ``uint64`` scalar: the arithmetic runs with
    64-bit integers enabled locally, so the ordinary computation keeps 32-bit defaults.

    Args:
        tree: any PyTree of arrays (parameters, updates, optimizer state).
        flat_index: scalar integer index; out-of-range indices select 0.

    Returns:
        The selected coordinate as a float32 scalar (float64 if any leaf is float64).
    """
    from zkdv.jax import _context

    collector = _context.collector()
    leaves = jax.tree.leaves(tree)
    dtype = selection_dtype(leaves)
    if collector is not None:
        # Tracing the attested function to derive its full transition: record the
        # tree the user selects from, and let the (discarded) selection be a constant.
        collector.append(tree)
        return jnp.zeros((), dtype)
    with jax.enable_x64(True):
        position = jnp.asarray(flat_index).astype(jnp.uint64)
        result = jnp.zeros((), dtype)
        offset = 0
        for leaf in leaves:
            array = jnp.asarray(leaf)
            size = int(np.prod(array.shape, dtype=np.int64))
            if size == 0:
                continue
            inside = (position >= jnp.uint64(offset)) & (position < jnp.uint64(offset + size))
            local = jnp.where(inside, position - jnp.uint64(offset), jnp.uint64(0))
            value = lax.dynamic_index_in_dim(array.reshape(-1), local, keepdims=False)
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value).reshape(-1)[0]
            result = jnp.where(inside, value.astype(dtype), result)
            offset += size
    return result


def _is_key(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


@dataclass(frozen=True)
class PackedLeaf:
    """Where one dynamic input lives in the committed uint32 batch.

    Attributes:
        path: the input's path in the function's arguments.
        dtype: its dtype name (``key<impl>`` for typed PRNG keys).
        shape: its shape.
        offset: first column of its words in every row.
        words: columns it occupies in every row.
        shared: the whole input is replicated in every row (read back from row 0).
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    words: int
    shared: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "words": self.words,
            "shared": self.shared,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackedLeaf:
        return cls(
            str(data["path"]),
            str(data["dtype"]),
            tuple(int(d) for d in data["shape"]),
            int(data["offset"]),
            int(data["words"]),
            bool(data.get("shared", False)),
        )


@dataclass(frozen=True)
class BatchLayout:
    """Lossless packing of dynamic inputs into one ``(rows, cols)`` uint32 batch.

    Every element becomes whole uint32 words: 32-bit values are bitcast, 8- and 16-bit
    values are bitcast to unsigned integers and zero-extended (one word each, so a
    token stays one word), booleans become 0/1, 64-bit values are split into two words
    (low word first, the platform's little-endian bitcast), typed PRNG keys are stored
    as their key data.

    *Row mode*: when some input has rank >= 2, its leading dimension ``R`` is the number
    of examples; every input whose leading dimension is ``R`` contributes example ``r``
    to row ``r``, and every other input (a PRNG key, a scalar) of at most
    ``SHARED_WORDS`` words is replicated whole in every row, so that each row is one
    self-contained example. Inputs are concatenated in argument order. Otherwise (no
    rank-2 input, or a large input that is not per-example) the batch is one row holding
    every input flattened in C order.
    """

    rows: int
    cols: int
    leaves: tuple[PackedLeaf, ...]
    keys: tuple[str | None, ...]

    @classmethod
    def of(cls, paths: Sequence[str], leaves: Sequence[Any]) -> BatchLayout:
        """Fix the layout from the first invocation's inputs (arrays or tracers)."""
        if not leaves:
            raise ValueError(
                "a ZKDV step needs at least one dynamic input besides the training state "
                "(the batch): nothing would be committed as training data"
            )
        shapes = [tuple(int(d) for d in jnp.shape(leaf)) for leaf in leaves]
        totals: list[int] = []
        keys: list[str | None] = []
        for path, leaf, shape in zip(paths, leaves, shapes, strict=True):
            dtype = leaf.dtype
            key_impl = None
            if _is_key(dtype):
                key_impl = str(jax.random.key_impl(leaf))
                key_words = int(np.prod(jax.random.key_data(leaf).shape[len(shape) :]))
                per_element = key_words
            else:
                itemsize = jnp.dtype(dtype).itemsize
                if jnp.issubdtype(dtype, jnp.complexfloating) or itemsize > 8:
                    raise TypeError(
                        f"ZKDV cannot pack input {path} of dtype {dtype} into the committed "
                        "uint32 batch; pass real-valued arrays"
                    )
                per_element = 2 if itemsize == 8 else 1
            totals.append(int(np.prod(shape, dtype=np.int64)) * per_element)
            keys.append(key_impl)
        examples = next((shape[0] for shape in shapes if len(shape) >= 2), 1)
        per_example = [len(shape) >= 1 and shape[0] == examples for shape in shapes]
        rows = 1
        if examples > 1 and all(
            row or total <= SHARED_WORDS for row, total in zip(per_example, totals, strict=True)
        ):
            rows = examples
        packed: list[PackedLeaf] = []
        offset = 0
        for path, leaf, shape, total, row in zip(
            paths, leaves, shapes, totals, per_example, strict=True
        ):
            shared = rows > 1 and not row
            words = total if shared or rows == 1 else total // rows
            packed.append(PackedLeaf(path, str(leaf.dtype), shape, offset, words, shared))
            offset += words
        if offset == 0:
            raise ValueError("the dynamic inputs committed as the batch are all empty")
        return cls(rows, offset, tuple(packed), tuple(keys))

    def pack(self, leaves: Sequence[Any]) -> jax.Array:
        """The ``(rows, cols)`` uint32 batch of these inputs (traceable)."""
        columns = []
        for spec, key, leaf in zip(self.leaves, self.keys, leaves, strict=True):
            x = jnp.asarray(leaf) if key is None else jax.random.key_data(leaf)
            dtype = x.dtype
            if dtype == jnp.bool_:
                words = x.astype(jnp.uint32)
            elif dtype.itemsize == 4:
                words = lax.bitcast_convert_type(x, jnp.uint32)
            elif dtype.itemsize == 2:
                words = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
            elif dtype.itemsize == 1:
                words = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
            else:
                words = lax.bitcast_convert_type(x, jnp.uint32)
            if spec.shared:
                columns.append(
                    jnp.broadcast_to(words.reshape(1, spec.words), (self.rows, spec.words))
                )
            else:
                columns.append(words.reshape(self.rows, spec.words))
        return columns[0] if len(columns) == 1 else jnp.concatenate(columns, axis=1)

    def unpack(self, batch: Any) -> list[jax.Array]:
        """Invert :meth:`pack`: the original inputs, bit for bit (traceable)."""
        batch = jnp.asarray(batch)
        out = []
        for spec, key in zip(self.leaves, self.keys, strict=True):
            first = 1 if spec.shared else batch.shape[0]
            words = batch[:first, spec.offset : spec.offset + spec.words]
            if key is not None:
                data = words.reshape(*spec.shape, -1)
                out.append(jax.random.wrap_key_data(data, impl=key))
                continue
            dtype = jnp.dtype(spec.dtype)
            if dtype == jnp.bool_:
                value = words != 0
            elif dtype.itemsize == 4:
                value = lax.bitcast_convert_type(words, dtype)
            elif dtype.itemsize == 2:
                value = lax.bitcast_convert_type(words.astype(jnp.uint16), dtype)
            elif dtype.itemsize == 1:
                value = lax.bitcast_convert_type(words.astype(jnp.uint8), dtype)
            else:
                value = lax.bitcast_convert_type(words.reshape(*words.shape[:-1], -1, 2), dtype)
            out.append(value.reshape(spec.shape))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "cols": self.cols,
            "leaves": [leaf.to_dict() for leaf in self.leaves],
            "keys": list(self.keys),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchLayout:
        return cls(
            int(data["rows"]),
            int(data["cols"]),
            tuple(PackedLeaf.from_dict(leaf) for leaf in data["leaves"]),
            tuple(None if k is None else str(k) for k in data["keys"]),
        )
