"""The committed batch packing is lossless for every dtype and layout (property test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkdv.torch._packing import BatchLayout

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=generator)  # fmt: skip
    # Arbitrary bit patterns (NaN payloads, negative zero, subnormals) must survive.
    return raw.view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    rows=st.integers(1, 6),
    widths=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    window=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_pack_then_unpack_is_the_identity(dtypes, rows, widths, window, seed) -> None:
    batch = {
        f"leaf{i}": _tensor(dtype, (rows, widths[i] + 1), seed + i)
        for i, dtype in enumerate(dtypes)
    }
    batch["static"] = 3  # plain values are part of the layout, not the words
    layout = BatchLayout.of(batch, window)
    words = layout.pack(batch)
    assert words.dtype == np.uint32 and words.shape == (layout.rows, layout.cols)
    assert rows % layout.rows == 0
    restored = layout.unpack(words)
    assert restored["static"] == 3
    for key, value in batch.items():
        if key != "static":
            assert restored[key].dtype == value.dtype
            assert torch.equal(restored[key].view(torch.uint8), value.view(torch.uint8))


def test_rows_are_samples_when_wide_enough_and_grouped_otherwise() -> None:
    tokens = torch.arange(4 * 64).reshape(4, 64)
    assert BatchLayout.of((tokens,), 32).rows == 4  # 128 words per sample
    small = (torch.randn(8, 10), torch.randint(2, (8,)))
    layout = BatchLayout.of(small, 32)
    assert (layout.rows, layout.cols) == (2, 48)  # four samples of 12 words per row
    assert BatchLayout.of((torch.tensor(1.0),), 1).rows == 1


def test_a_changed_batch_layout_is_rejected() -> None:
    layout = BatchLayout.of((torch.randn(4, 3), 5))
    with pytest.raises(ValueError, match="batch tensor changed"):
        layout.pack((torch.randn(4, 2), 5))
    with pytest.raises(ValueError, match="static batch value changed"):
        layout.pack((torch.randn(4, 3), 6))
    with pytest.raises(ValueError, match="structure changed"):
        layout.pack([torch.randn(4, 3), 5])
