"""Tensors as numpy arrays, bit for bit: what commitments and replays hash.

:func:`host_array` is the one conversion the SDK (committing a step) and the platform's
Torch prover (recomputing it) share, so both hash the same bytes: a bfloat16 tensor
becomes ``ml_dtypes.bfloat16`` where installed (with JAX), else its raw uint16 words.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["host_array", "tensor_like"]

try:  # bfloat16 has no numpy dtype; ml_dtypes (installed with JAX) provides one.
    import ml_dtypes

    _BFLOAT16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - depends on the environment
    _BFLOAT16 = None


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy view (CPU) or copy (accelerator) of ``tensor``, bit for bit."""
    value = tensor.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    if value.dtype == torch.bfloat16:
        raw = value.view(torch.int16).numpy()
        return raw.view(_BFLOAT16) if _BFLOAT16 is not None else raw.view(np.uint16)
    return value.numpy()


def tensor_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``array``'s values (a :func:`host_array` of a tensor like ``like``) in a new tensor
    of ``like``'s dtype, device and memory format, bit for bit."""
    values = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
    if like.dtype == torch.bfloat16:
        source = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        source = torch.from_numpy(values)
    return torch.empty_like(like, memory_format=torch.preserve_format).copy_(source)
