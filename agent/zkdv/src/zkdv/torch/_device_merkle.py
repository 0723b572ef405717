"""``zkdv.merkle`` chunk roots computed by Torch on the device that holds the tensors.

The algorithm is :mod:`zkdv.device_merkle` (BLAKE3 and the RFC 6962 chunk tree) over
Torch tensor operations; the roots are bit-identical to
:func:`zkdv.merkle.commit_state` on the tensors' host bytes. Torch 2.13 has no uint32
arithmetic (``add`` and shifts are not implemented for ``torch.uint32``), so words are
``int32`` tensors holding the same bits: additions wrap, and a logical right shift is an
arithmetic one with the sign bits masked off.

Eagerly, every operation is its own kernel; on CUDA pass ``compiled=True`` (Inductor
fuses the compression into Triton kernels) for throughput. Both give the same bits.

The driver-facing entry points are :func:`chunk_roots` (dispatch; the result stays on
the device) and :func:`state_commitment` (reads 32 bytes per leaf and finishes the
state root on the host).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from zkdv.device_merkle import EagerOps, HashPlan
from zkdv.device_merkle import chunk_roots as _chunk_roots
from zkdv.device_merkle import state_commitment as _commit
from zkdv.merkle import LeafSpec, StateCommitment

__all__ = ["TorchOps", "chunk_roots", "leaf_spec", "leaf_words", "roots_bytes", "state_commitment"]

_NUMPY_NAMES = {torch.bfloat16: "bfloat16"}


def _signed(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


class TorchOps(EagerOps):
    """:class:`zkdv.device_merkle.Ops` over ``int32`` tensors holding uint32 bits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def const(self, value: int) -> Any:
        return _signed(value)

    def full(self, count: int, value: int) -> Any:
        return torch.full((count,), _signed(value), dtype=torch.int32, device=self.device)

    def array(self, values: np.ndarray) -> Any:
        values = np.asarray(values)
        if values.dtype == np.bool_:
            return torch.from_numpy(values.copy()).to(self.device)
        if values.dtype == np.uint32:
            values = values.view(np.int32)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(self.device)

    def shr(self, x: Any, n: int) -> Any:
        return (x >> n) & ((1 << (32 - n)) - 1)

    def shl(self, x: Any, n: int) -> Any:
        return x << n

    def rotr(self, x: Any, n: int) -> Any:
        return ((x >> n) & ((1 << (32 - n)) - 1)) | (x << (32 - n))

    def batch_shape(self, items: Sequence[Any]) -> tuple[int, ...]:
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else () for x in items]
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]

    def stack(self, items: Sequence[Any], shape: tuple[int, ...]) -> Any:
        rows = [
            x.broadcast_to(shape)
            if isinstance(x, torch.Tensor)
            else torch.full(shape, x, dtype=torch.int32, device=self.device)
            for x in items
        ]
        return torch.stack(rows)

    def unstack(self, x: Any) -> list[Any]:
        return list(x.unbind(0))

    def roll(self, x: Any, shift: int) -> Any:
        return torch.cat([x[shift:], x[:shift]])

    def concat(self, parts: Sequence[Any], axis: int = 0) -> Any:
        return torch.cat(list(parts), dim=axis)

    def take(self, x: Any, index: Any) -> Any:
        if isinstance(index, np.ndarray):
            index = torch.from_numpy(index.astype(np.int64)).to(self.device)
        return x.index_select(0, index.long())

    def select(self, mask: Any, a: Any, b: Any) -> Any:
        return torch.where(mask, a, b)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return torch.zeros(shape, dtype=torch.int32, device=self.device)

    def pad_to(self, x: Any, width: int) -> Any:
        return torch.nn.functional.pad(x, (0, width - x.shape[-1]))

    def flag(self, condition: Any, value: int) -> Any:
        return _signed(value) if condition else 0


def leaf_words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (C order, little endian) as 1-D int32 words, zero-padded."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.nn.functional.pad(raw, (0, 4 - raw.numel() % 4))
    return raw.view(torch.int32)


def leaf_spec(path: str, tensor: torch.Tensor) -> LeafSpec:
    """The :class:`LeafSpec` the host path writes for ``tensor`` (numpy's dtype name)."""
    name = _NUMPY_NAMES.get(tensor.dtype)
    if name is None:
        name = str(torch.empty((), dtype=tensor.dtype).numpy().dtype.name)
    return LeafSpec(path, name, tuple(int(d) for d in tensor.shape))


def _roots(plan: HashPlan, device: torch.device, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    words = [leaf_words(t) for t in tensors]
    return torch.stack(_chunk_roots(TorchOps(device), plan, words), dim=1)


@functools.lru_cache(maxsize=64)
def _plan(nbytes: tuple[int, ...], chunk_bytes: int) -> HashPlan:
    return HashPlan.build(nbytes, chunk_bytes)


_COMPILED: dict[tuple[Any, ...], Callable[..., torch.Tensor]] = {}


def chunk_roots(
    tensors: Sequence[torch.Tensor], chunk_bytes: int, *, compiled: bool = False
) -> torch.Tensor:
    """Dispatch the chunk root of every tensor: ``(len(tensors), 8)`` int32 on their device.

    Args:
        tensors: the state's leaves in canonical order, all on one device.
        chunk_bytes: the run's Merkle chunk size.
        compiled: run through ``torch.compile`` (one compilation per layout).

    Raises:
        ValueError: the tensors are on more than one device.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"device hashing needs every leaf on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    nbytes = tuple(t.numel() * t.element_size() for t in tensors)
    plan = _plan(nbytes, chunk_bytes)
    if not compiled:
        with torch.no_grad():
            return _roots(plan, device, tensors)
    key = (nbytes, chunk_bytes, str(device))
    function = _COMPILED.get(key)
    if function is None:
        function = _COMPILED[key] = torch.compile(
            functools.partial(_roots, plan, device), fullgraph=True, dynamic=False
        )
    with torch.no_grad():
        return function(list(tensors))


def roots_bytes(roots: torch.Tensor) -> list[bytes]:
    """Read ``chunk_roots``' result (``32 * len(tensors)`` bytes device-to-host) as digests."""
    words = roots.cpu().numpy().view(np.uint32).astype("<u4")
    return [words[i].tobytes() for i in range(words.shape[0])]


def state_commitment(
    leaves: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int, *, compiled: bool = False
) -> StateCommitment:
    """The commitment :func:`zkdv.merkle.commit_state` gives the leaves' host copies.

    Only the chunk roots (32 bytes per leaf) cross to the host; the tensor digests and
    the state root are computed there from the leaves' specs.
    """
    specs = [leaf_spec(path, tensor) for path, tensor in leaves]
    roots = chunk_roots([t for _, t in leaves], chunk_bytes, compiled=compiled)
    return _commit(specs, roots_bytes(roots))
