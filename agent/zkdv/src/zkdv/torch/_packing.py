"""Lossless packing of a user's Torch batch into the committed uint32 rows.

The protocol commits a rectangular ``(rows, cols)`` uint32 array per step. A Torch
batch is any pytree (``torch.utils._pytree``) of tensors and plain values; it is packed
as follows (version 1, recorded as ``env.batch`` in the root record):

* **Rows.** When every tensor leaf has at least one dimension and all share the same
  leading size ``B``, row ``r`` holds samples ``r*g .. r*g+g-1`` of every leaf, where
  ``g`` is the smallest divisor of ``B`` whose rows are at least ``rolling_window``
  words wide (usually ``g = 1``: one sample per row; a tiny sample such as ten features
  and a label is grouped so that rolling-hash windows fit in a row). Otherwise the
  batch is one row holding everything.
* **Columns.** Within a row the leaves follow in pytree order. Each leaf contributes
  its row's elements in C order as raw little-endian bytes, bit for bit: a float is
  bitcast (never converted), a 64-bit integer or float occupies two words (low word
  first), 16- and 8-bit types are packed two or four to a word. A leaf's bytes are
  zero-padded to a whole number of words, so every leaf starts on a word boundary.
* **Plain values** (ints, floats, strings, None) are not committed: they are static
  parts of the attested step, recorded in the layout, and a later batch whose plain
  values differ is rejected.

:meth:`BatchLayout.unpack` inverts the packing exactly; the replay of a sampled step
rebuilds the batch from the committed words alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from zkdv.batch import count_tokens
from zkdv.torch._strides import dim_order, in_order

__all__ = ["BatchLayout", "LeafLayout"]

PACKING_VERSION = 1


@dataclass(frozen=True)
class LeafLayout:
    """Where one tensor leaf lives in a packed row."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    words: int
    row_bytes: int
    #: The tensor's dimension order when it is not C order (``channels_last`` images),
    #: which the unpacked tensor takes again (:mod:`zkdv.torch._strides`).
    dim_order: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "offset": self.offset,
            "words": self.words,
        }
        if self.dim_order is not None:
            out["dim_order"] = list(self.dim_order)
        return out


@dataclass(frozen=True)
class BatchLayout:
    """The packing of one batch structure: rows, leaf positions, static values."""

    spec: Any
    rows: int
    cols: int
    leaves: tuple[LeafLayout | None, ...]
    statics: tuple[Any, ...]
    tokens: int

    @classmethod
    def of(
        cls,
        batch: Any,
        min_words: int = 1,
        token_unit: str = "examples",  # noqa: S107 - a unit, not a secret
    ) -> BatchLayout:
        """Derive the layout from the first batch.

        Args:
            batch: the first transaction's batch.
            min_words: the narrowest acceptable row (the run's ``rolling_window``).
            token_unit: what ``tokens`` counts (:func:`zkdv.batch.count_tokens`).

        Raises:
            ValueError: the batch holds no tensor, or a tensor of an unpackable type.
        """
        values, spec = pytree.tree_flatten(batch)
        tensors = [value for value in values if isinstance(value, torch.Tensor)]
        if not tensors:
            raise ValueError("a ZKDV Torch transaction batch must contain at least one tensor")
        leading = {tensor.shape[0] if tensor.dim() else None for tensor in tensors}
        samples = leading.pop() if len(leading) == 1 and None not in leading else 1
        samples = max(int(samples or 1), 1)
        rows = 1
        for group in range(1, samples + 1):
            if samples % group:
                continue
            candidate = samples // group
            width = sum(
                math.ceil(tensor.numel() // candidate * tensor.element_size() / 4)
                for tensor in tensors
            )
            if width >= min_words:
                rows = candidate
                break
        offset = 0
        leaves: list[LeafLayout | None] = []
        statics: list[Any] = []
        for value in values:
            if not isinstance(value, torch.Tensor):
                leaves.append(None)
                statics.append(value)
                continue
            if value.layout is not torch.strided:
                raise ValueError("ZKDV Torch transaction batches hold dense tensors only")
            itemsize = value.element_size()
            row_bytes = value.numel() // rows * itemsize
            words = math.ceil(row_bytes / 4)
            order = dim_order(value)
            leaves.append(
                LeafLayout(
                    value.dtype,
                    tuple(value.shape),
                    offset,
                    words,
                    row_bytes,
                    None if order is None else tuple(order),
                )
            )
            statics.append(None)
            offset += words
        if offset == 0:
            raise ValueError("the ZKDV Torch transaction batch holds only empty tensors")
        tokens = count_tokens([(t.shape, t.dtype) for t in tensors], token_unit)
        return cls(spec, rows, offset, tuple(leaves), tuple(statics), tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "packing": PACKING_VERSION,
            "rows": self.rows,
            "cols": self.cols,
            "tree": str(self.spec),
            "leaves": [leaf.to_dict() if leaf else None for leaf in self.leaves],
        }

    def pack(self, batch: Any) -> np.ndarray:
        """Copy ``batch`` into a fresh ``(rows, cols)`` uint32 host array.

        Raises:
            ValueError: the batch's structure, shapes, dtypes or static values differ
                from the first batch's.
        """
        values, spec = pytree.tree_flatten(batch)
        if spec != self.spec:
            raise ValueError(
                "the transaction batch structure changed; the first transaction fixed "
                f"{self.spec}, got {spec}"
            )
        out = np.zeros((self.rows, self.cols), dtype=np.uint32)
        as_bytes = out.view(np.uint8)
        for value, leaf, static in zip(values, self.leaves, self.statics, strict=True):
            if leaf is None:
                if value != static:
                    raise ValueError(
                        f"a static batch value changed from {static!r} to {value!r}; plain "
                        "values are part of the attested step, pass tensors for data"
                    )
                continue
            if value.dtype != leaf.dtype or tuple(value.shape) != leaf.shape:
                raise ValueError(
                    f"a batch tensor changed from {leaf.dtype}{list(leaf.shape)} to "
                    f"{value.dtype}{list(value.shape)}; the first transaction fixed the layout"
                )
            host = value.detach().to("cpu").contiguous().reshape(self.rows, -1)
            raw = host.view(torch.uint8).numpy()
            start = leaf.offset * 4
            as_bytes[:, start : start + leaf.row_bytes] = raw
        return out

    def unpack(self, words: np.ndarray, device: torch.device | str = "cpu") -> Any:
        """Rebuild the batch pytree from packed words (the inverse of :meth:`pack`).

        Raises:
            ValueError: ``words`` is not ``(rows, cols)`` of this layout.
        """
        array = np.ascontiguousarray(words, dtype=np.uint32)
        if array.shape != (self.rows, self.cols):
            raise ValueError(
                f"packed batch is {array.shape}, the layout is {(self.rows, self.cols)}"
            )
        as_bytes = array.view(np.uint8)
        values = []
        for leaf, static in zip(self.leaves, self.statics, strict=True):
            if leaf is None:
                values.append(static)
                continue
            start = leaf.offset * 4
            # A copy, not ascontiguousarray: a one-row slice counts as contiguous to numpy
            # yet keeps the full row stride, which Tensor.view(dtype) rejects.
            raw = as_bytes[:, start : start + leaf.row_bytes].copy()
            tensor = torch.from_numpy(raw).view(leaf.dtype).reshape(leaf.shape)
            values.append(in_order(tensor, leaf.dim_order).to(device))
        return pytree.tree_unflatten(values, self.spec)

    def tensor_leaves(self, batch: Any) -> list[torch.Tensor]:
        """The tensor leaves of ``batch`` in pytree order."""
        return [value for value in pytree.tree_leaves(batch) if isinstance(value, torch.Tensor)]

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        """The batch pytree with ``tensors`` in place of its tensor leaves."""
        supply = iter(tensors)
        values = [
            next(supply) if leaf is not None else static
            for leaf, static in zip(self.leaves, self.statics, strict=True)
        ]
        return pytree.tree_unflatten(values, self.spec)
