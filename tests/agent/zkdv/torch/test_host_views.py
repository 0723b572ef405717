"""The commit stage's kept host views (zkdv.torch._arrays.HostViews) always show the bytes
of the tensors they are asked for: after an in-place update, after a tensor is replaced
in place (``p.data = ...``), and after its layout changes."""

from __future__ import annotations

import numpy as np
import torch

from zkdv.torch._arrays import HostViews, host_array


def test_a_kept_view_shows_in_place_updates() -> None:
    views = HostViews()
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    first = views.arrays("parameters", [weight])[0]
    with torch.no_grad():
        weight.add_(1.5)
    second = views.arrays("parameters", [weight])[0]
    assert second is first  # kept, not made again
    np.testing.assert_array_equal(second, np.full((4, 3), 1.5, np.float32))


def test_a_replaced_tensor_gets_a_new_view() -> None:
    views = HostViews()
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    first = views.arrays("parameters", [weight])[0]
    weight.data = torch.ones(4, 3)  # the same Parameter object, new memory
    second = views.arrays("parameters", [weight])[0]
    assert second is not first
    np.testing.assert_array_equal(second, np.ones((4, 3), np.float32))


def test_a_view_follows_the_layout_of_the_same_memory() -> None:
    views = HostViews()
    storage = torch.arange(12, dtype=torch.float32)
    flat = views.arrays("state", [storage.view(12)])[0]
    square = views.arrays("state", [storage.view(3, 4)])[0]  # same address, other shape
    assert square.shape == (3, 4) and flat.shape == (12,)
    transposed = views.arrays("state", [storage.view(3, 4).t()])[0]  # other strides
    np.testing.assert_array_equal(transposed, storage.view(3, 4).t().numpy())
    halves = views.arrays("state", [storage.view(torch.int32)])[0]  # other dtype
    assert halves.dtype == np.int32


def test_each_position_and_name_is_kept_apart_and_matches_host_array() -> None:
    views = HostViews()
    tensors = [torch.randn(5), torch.randn(2, 2).to(torch.bfloat16), torch.tensor(3.0)]
    for _ in range(2):
        arrays = views.arrays("state", tensors)
        for tensor, array in zip(tensors, arrays, strict=True):
            expected = host_array(tensor)
            assert array.dtype == expected.dtype and array.shape == expected.shape
            assert array.tobytes() == expected.tobytes()
    other = views.arrays("parameters", tensors[:1])
    assert other[0].tobytes() == host_array(tensors[0]).tobytes()
    fewer = views.arrays("state", tensors[1:])  # another list under the same name
    assert [a.tobytes() for a in fewer] == [host_array(t).tobytes() for t in tensors[1:]]


def test_host_array_views_tensors_with_and_without_autograd() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 3))
    product = weight * 2  # tracked by autograd, not a leaf
    plain = torch.randn(5)
    for tensor in (weight, product, plain):
        array = host_array(tensor)
        np.testing.assert_array_equal(array, tensor.detach().numpy())
        assert np.shares_memory(array, tensor.detach().numpy())  # a view, not a copy
