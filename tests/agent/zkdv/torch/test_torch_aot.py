"""The sealed AOT Inductor artifact: committed bytes, reload, replay within tolerance.

One cold AOT compile (~40-60 s on two cores; less with the shared Inductor cache). The
model and batch are the quick start's, so this test and the quick start test share
compiled kernels through the cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from zkdv import untrusted
from zkdv.core import file_digest
from zkdv.records import iter_records
from zkdv.torch import _artifact
from zkdv.verify import verify_transcript

# An AOT Inductor compile is ~40 s cold on two cores, several times that on busy ones.
pytestmark = [pytest.mark.aot, pytest.mark.slow, pytest.mark.timeout(600)]


def test_aot_artifact_is_committed_reloaded_and_replays_within_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZKDV_TORCH_PROGRAM", "aot-inductor")
    config = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(1))
    proof = zkdv.torch.ZKDV(tmp_path / "proof", config, replay_snapshot_interval=2)
    proof.start(rolling_window=4, probe_ratio=0.5)
    model = nn.Linear(10, 2)
    model, optimizer = proof.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    @proof.attest
    def attested_step(model, optimizer, batch):
        inputs, targets = batch
        loss = functional.cross_entropy(proof.forward(model, inputs), targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    batches = [(torch.randn(8, 10), torch.randint(2, (8,))) for _ in range(4)]
    for inputs, targets in batches:
        with proof.transaction(batch=(inputs, targets)):
            loss = functional.cross_entropy(model(inputs), targets)
            proof.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    proof.close()

    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.checks == 4
    assert proof.sealing_seconds > 0
    root = report.root
    assert root["program"]["kind"] == "aot-inductor"
    material = (tmp_path / "proof" / "program.pt2").read_bytes()
    assert file_digest(material) == root["program"]["digest"]
    lowered = proof._lowered_program
    assert lowered is not None and bytes(lowered.material) == material

    # Sampled checks replayed with the compiled program against eager commitments:
    # within tolerance, and (here) not all bitwise equal.
    checks = [r.data for r in iter_records(tmp_path / "proof") if r.data["t"] == "check"]
    tolerance = config.tolerance
    for check in checks:
        assert tolerance.close(check["param"]["replayed"], check["param"]["committed"])

    # The committed bytes are the torch.export program, no compiled code: two compiles
    # of them (the SDK's and the platform's, each from the bytes) give the same bits on
    # the same machine, and are close to eager. The first fills the platform's compile
    # cache (ZKDV_AOTI_CACHE); an entry damaged there does not load, so the second
    # compiles again and replaces it.
    untrusted.safe_export_archive(material)
    cache = tmp_path / "compiled"
    monkeypatch.setenv("ZKDV_AOTI_CACHE", str(cache))
    first = _artifact.load(material, _artifact.AOT_INDUCTOR)
    (entry,) = cache.iterdir()
    assert entry.name.startswith(f"{hashlib.sha256(material).hexdigest()}-")
    entry.write_bytes(b"damaged")
    second = _artifact.load(material, _artifact.AOT_INDUCTOR)
    assert entry.read_bytes()[:2] == b"PK"  # a zip archive again: compiled and replaced
    inputs = (*(p.detach() for p in model.parameters()), *batches[0])
    compiled = first(*inputs)
    for a, b in zip(compiled, second(*inputs), strict=True):
        assert torch.equal(a, b)
    eager = lowered.graph(*inputs)
    torch.testing.assert_close(compiled, list(eager), rtol=1e-5, atol=1e-6)
