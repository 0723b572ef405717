"""Shared setup for the Torch frontend tests.

AOT Inductor compiles are the slow part (a cold compile is ~40-80 s on two cores), so
every test shares one Inductor cache under the repository's ``.data/`` and only the
tests marked ``aot`` compile at all: the others seal the attested program as a
``torch.export`` artifact (``ZKDV_TORCH_PROGRAM=torch.export``), which exercises the same
tracing, checks and replay in about a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[4]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".data" / "torchinductor"))

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _fast_program_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("ZKDV_TORCH_PROGRAM", "torch.export")
    torch.manual_seed(0)
    yield
