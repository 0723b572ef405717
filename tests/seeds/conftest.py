"""Shared setup of the seeds' tests: each runs in its own folder, quickly.

The seeds' examples write their proof to ``"proof"`` in the current folder, so every test
runs in ``tmp_path``. Two settings keep them fast without changing a call the seeds
show: JAX programs are lowered for the local platform only (the multi-platform export
is tested in tests/agent/zkdv/jax/test_jax_examples.py), and Torch seals its attested
program as a ``torch.export`` artifact rather than compiling AOT Inductor (~40 s on two
cores; the ``aot`` tests in tests/agent/zkdv/torch/ cover that path).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZKDV_JAX_EXPORT_PLATFORMS", "")
    monkeypatch.setenv("ZKDV_TORCH_PROGRAM", "torch.export")
