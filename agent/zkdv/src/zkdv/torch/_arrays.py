"""Tensors as numpy arrays, bit for bit: what commitments and replays hash.

:func:`host_array` is the one conversion the SDK (committing a step) and the platform's
Torch prover (recomputing it) share, so both hash the same bytes: a bfloat16 tensor
becomes ``ml_dtypes.bfloat16`` where installed (with JAX), else its raw uint16 words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["HostViews", "host_array", "tensor_like"]

try:  # bfloat16 has no numpy dtype; ml_dtypes (installed with JAX) provides one.
    import ml_dtypes

    _BFLOAT16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - depends on the environment
    _BFLOAT16 = None


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy view (CPU) or copy (accelerator) of ``tensor``, bit for bit."""
    # A commit converts a few hundred tensors a step: detach only what autograd tracks.
    value = tensor.detach() if tensor.requires_grad else tensor
    if value.device.type != "cpu":
        value = value.cpu()
    if value.dtype == torch.bfloat16:
        raw = value.view(torch.int16).numpy()
        return raw.view(_BFLOAT16) if _BFLOAT16 is not None else raw.view(np.uint16)
    return value.numpy()


class HostViews:
    """:func:`host_array` of the same CPU tensors step after step, each view made once.

    A run commits its parameters and optimizer state every step, and the optimizer
    updates them in place: the same memory, step after step. A kept view is reused while
    the tensor at its position lies at the same address with the same dtype, shape and
    strides. A view keeps the memory it reads alive (through the tensor numpy made it
    from), so no other tensor can be given that address meanwhile: a match is that
    memory, read as that tensor. Anything else (a new tensor, an accelerator's) is
    converted again. Not thread-safe: one commit stage uses it.
    """

    def __init__(self) -> None:
        self._kept: dict[str, list[tuple[int, Any, np.ndarray] | None]] = {}

    def arrays(self, name: str, tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """The host arrays of ``tensors``, kept under ``name`` (one list per name)."""
        kept = self._kept.get(name)
        if kept is None or len(kept) != len(tensors):
            kept = self._kept[name] = [None] * len(tensors)
        out: list[np.ndarray] = []
        for index, tensor in enumerate(tensors):
            entry = kept[index]
            address = tensor.data_ptr()
            layout = (tensor.dtype, tensor.shape, tensor.stride())
            if entry is not None and entry[0] == address and entry[1] == layout:
                out.append(entry[2])
                continue
            array = host_array(tensor)
            kept[index] = (address, layout, array) if tensor.device.type == "cpu" else None
            out.append(array)
        return out


def tensor_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``array``'s values (a :func:`host_array` of a tensor like ``like``) in a new tensor
    of ``like``'s dtype, device and memory format, bit for bit."""
    values = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
    if like.dtype == torch.bfloat16:
        source = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        source = torch.from_numpy(values)
    return torch.empty_like(like, memory_format=torch.preserve_format).copy_(source)
