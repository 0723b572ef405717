"""Initialise Intel MKL's vector math (VML) on one thread, before any training thread uses it.

Torch computes ``sqrt``, ``exp``, ``log``, ``tanh``, ``sin``, ``cos``, ``erf`` and their
kind on contiguous CPU tensors with MKL's VML, in chunks of 2,048 elements spread over
its intra-op threads. VML's first use in a process is not thread-safe (MKL 2024.2, in
Torch 2.13's CPU wheel): when the process's first VML call runs on two threads at once,
one thread computes its chunk less accurately, about 2**18 float64 ulps (2**-34,
relative) from the true value, in about one fresh process in eight. That first
operation's bits then depend on a race. When it was the canonical optimizer update's
float64 square root, one float32 parameter element in one run in twenty of the BatchNorm
recipe was rounded the other way, and the platform's replay rejected an honest step.

One VML call on one thread, when :mod:`zkdv.torch` is imported, completes MKL's
initialisation: every later call, on any number of threads, is within MKL's documented
accuracy (``tests/agent/zkdv/torch/test_vml.py`` runs fresh processes to show it).
"""

from __future__ import annotations

import torch

__all__ = ["initialize"]


def initialize() -> None:
    """Make the process's first VML calls, on this thread only (fewer than 2,048 elements)."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return
    torch.ones(16, dtype=torch.float64).sqrt()
    torch.ones(16, dtype=torch.float32).exp()
