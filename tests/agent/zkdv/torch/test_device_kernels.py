"""Torch device kernels (``zkdv.torch._device_merkle``, ``zkdv.torch._device_probes``).

They are ready for the Torch driver to call (docs/torch.md, "Device-side commitments"):
here they run eagerly on CPU tensors and must give the host path's commitments and
probes bit for bit; on a CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkdv.merkle import LeafSpec, commit_state
from zkdv.probes import ProbeSet
from zkdv.torch._device_merkle import chunk_roots, leaf_spec, roots_bytes, state_commitment
from zkdv.torch._device_probes import DeviceProbes
from zkdv.torch._eager import host_array

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return [
        ("f32", randn(3, 5)),
        ("empty", torch.zeros(0)),
        ("f16", randn(1000).half()),
        ("bf16", randn(1023).bfloat16()),
        ("f64", randn(7, 9).double()),
        ("i8", torch.randint(-128, 128, (333,), generator=generator, dtype=torch.int8)),
        ("i16", torch.randint(-(2**15), 2**15, (17,), generator=generator, dtype=torch.int16)),
        (
            "i32",
            torch.randint(-(2**31), 2**31 - 1, (1025,), generator=generator, dtype=torch.int32),
        ),
        ("i64", torch.randint(-(2**62), 2**62, (9,), generator=generator, dtype=torch.int64)),
        ("u8", torch.randint(0, 256, (4097,), generator=generator, dtype=torch.uint8)),
        ("bool", torch.rand(77, generator=generator) > 0.5),
        ("big", randn(5000)),
        ("step", torch.tensor(3)),
    ]


@pytest.mark.parametrize("chunk_bytes", [64, 1024, 4096, 1 << 20])
def test_state_commitment_is_the_host_commitment(chunk_bytes: int) -> None:
    leaves = [(path, tensor.to(DEVICE)) for path, tensor in _tensors(chunk_bytes)]
    expected = commit_state([(p, host_array(t)) for p, t in leaves], chunk_bytes)
    assert state_commitment(leaves, chunk_bytes) == expected


@settings(max_examples=25, deadline=None)
@given(st.binary(max_size=6000), st.sampled_from([64, 1024, 2048]))
def test_any_bytes_hash_like_the_host(data: bytes, chunk_bytes: int) -> None:
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0)
    tensor = tensor.to(DEVICE)
    expected = commit_state([("x", host_array(tensor))], chunk_bytes).chunk_roots
    assert roots_bytes(chunk_roots([tensor], chunk_bytes)) == list(expected)


def test_leaf_specs_use_numpy_dtype_names() -> None:
    assert leaf_spec("w", torch.zeros(2, 3, dtype=torch.bfloat16)) == LeafSpec(
        "w", "bfloat16", (2, 3)
    )
    assert leaf_spec("b", torch.zeros((), dtype=torch.bool)).dtype == "bool"


def test_leaves_on_two_devices_are_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match="one device"):
        chunk_roots([torch.zeros(4), torch.zeros(4, device="cuda")], 64)


def test_device_probes_are_the_host_probes_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(2)
    wide = torch.randn(300, 257, generator=generator) * torch.exp2(
        torch.randint(-60, 60, (300, 257), generator=generator).float()
    )
    wide[3, 5] = float("inf")
    wide[12, :5] = float("nan")
    wide[11] = 1e-40
    tensors = [
        wide,
        torch.randn(7, generator=generator),
        torch.tensor(2.5),
        torch.randn(70, 33, generator=generator).bfloat16(),
        torch.randn(65, 8, generator=generator).half(),
        torch.zeros(5, 0),
        torch.randn(3, 1024, generator=generator).double(),
    ]
    tensors = [t.to(DEVICE) for t in tensors]
    arrays = [host_array(t) for t in tensors]
    probes = ProbeSet.create(
        [LeafSpec.of(str(i), a) for i, a in enumerate(arrays)], 0.05, b"seed" * 4
    )
    host = probes.project_all(arrays)
    device = DeviceProbes(probes, DEVICE)
    flat = device(tensors).cpu().numpy()
    assert flat.size == probes.floats == device.floats
    for leaf, (want, got) in enumerate(zip(host, device.split(flat), strict=True)):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), leaf


def test_delta_probes_of_kept_rows_match_the_host() -> None:
    # The Torch driver keeps the pre-update rows (the optimizer steps in place) and
    # commits the probe of post_rows - pre_rows as the delta.
    generator = torch.Generator().manual_seed(4)
    before = [torch.randn(100, 40, generator=generator), torch.randn(9, generator=generator)]
    after = [t + 1e-3 * torch.randn(t.shape, generator=generator) for t in before]
    specs = [LeafSpec.of(str(i), t.numpy()) for i, t in enumerate(before)]
    probes = ProbeSet.create(specs, 0.1, b"seed" * 4)
    device = DeviceProbes(probes, DEVICE)
    pre = device.select([t.to(DEVICE) for t in before])
    post = device.select([t.to(DEVICE) for t in after])
    flat = device.project_rows([b - a for a, b in zip(pre, post, strict=True)]).cpu().numpy()
    for leaf, got in enumerate(device.split(flat)):
        rows = [r.cpu().numpy() for r in (pre[leaf], post[leaf])]
        want = probes.project_rows(leaf, rows[1] - rows[0])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), leaf
