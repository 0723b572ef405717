"""The weights file the SDK writes: an internal API for the platform's tests.

:meth:`dvbench.DVBenchProof.save_model` writes a run's final parameters as a
safetensors file with :func:`write_safetensors`; the platform's tests of the upload that
must match the final parameter root (``tests/attestations/certificates``) write one
without a training run. The implementation is :mod:`dvbench._model`.
"""

from __future__ import annotations

from dvbench._model import write_safetensors

__all__ = ["write_safetensors"]
