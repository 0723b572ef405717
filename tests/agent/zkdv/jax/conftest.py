"""Fixtures of the JAX frontend tests; helpers live in ``jax_helpers`` beside this file."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zkdv
from zkdv.verify import verify_transcript

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("flax")

# --import-mode=importlib does not put test folders on sys.path; the helpers module is
# imported by name from the test files.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _local_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Multi-platform lowering (cpu + cuda) is tested once, in test_jax_examples; the
    # other tests lower for the local platform only, which keeps the suite fast.
    monkeypatch.setenv("ZKDV_JAX_EXPORT_PLATFORMS", "")


@pytest.fixture
def make_proof(tmp_path: Path) -> Iterator[Callable[..., zkdv.jax.ZKDV]]:
    """``make_proof(policy=DEBUGCheckEvery(1), interval=3, window=2, **config)``."""
    made: list[zkdv.jax.ZKDV] = []

    def make(
        policy: zkdv.SamplingPolicy | None = None,
        *,
        interval: int = 3,
        window: int = 2,
        name: str = "proof",
        max_in_flight: int = 2,
        **config: Any,
    ) -> zkdv.jax.ZKDV:
        proof = zkdv.jax.ZKDV(
            tmp_path / name,
            zkdv.ZKDVConfig(
                sampling_policy=policy or zkdv.SamplingPolicy.DEBUGCheckEvery(1), **config
            ),
            replay_snapshot_interval=interval,
            max_in_flight=max_in_flight,
        )
        proof.start(rolling_window=window, probe_ratio=0.5)
        made.append(proof)
        return proof

    yield make
    for proof in made:
        # Tests that expect a failure close explicitly; this releases threads and checks
        # that every transcript a test produced without a failure verifies offline.
        try:
            proof.close()
        except zkdv.ZKDVError:
            continue
        if (proof.path / "records.cborl").exists() and not proof._queue.poisoned:
            report = verify_transcript(proof.path)
            assert report.ok, f"{proof.path}: {report.summary()}"
