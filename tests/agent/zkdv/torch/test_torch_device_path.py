"""The Torch frontend's device path (``ZKDVConfig(commitments="device")``), on the CPU.

On a CPU the device path hashes with tensor code (slow; ``auto`` keeps the host there),
which is what lets these tests show, without a GPU, that it writes the host path's
transcript byte for byte and reads back only the record's worth of each step. A CUDA
run takes the same code path (``auto`` chooses it there).
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import zkdv
from provers import torch_replay
from zkdv.verify import verify_transcript

STEPS = 7
INTERVAL = 3
EVERY_OTHER = zkdv.SamplingPolicy.DEBUGCheckEvery(2)


def _run(
    path: Path,
    commitments: str,
    *,
    width: int = 16,
    tamper: bool = False,
    probe_ratio: float = 0.5,
) -> Any:
    """A BatchNorm MLP with Adam (host step counters), every other step checked."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = zkdv.ZKDVConfig(sampling_policy=EVERY_OTHER, commitments=commitments, chunk_bytes=256)
    proof = zkdv.torch.ZKDV(path, config, replay_snapshot_interval=INTERVAL)
    proof.start(rolling_window=4, probe_ratio=probe_ratio)
    # Everything else that varies from run to run: the clock and the probe seed.
    assert proof._core is not None
    proof._core.clock = lambda: 1_700_000_000.0
    proof._core.probe_seed = bytes(16)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def train_step(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, labels = batch
        proof.backward(functional.cross_entropy(proof.forward(model, inputs), labels))
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    try:
        for index in range(STEPS):
            batch = (
                torch.randn(8, 6, generator=generator),
                torch.randint(3, (8,), generator=generator),
            )
            with proof.transaction(batch=batch, overlap=zkdv.overlap.NEVER):
                train_step(model, optimizer, batch)
                if tamper and index == 4:
                    with torch.no_grad():  # inside the step, after the update: committed
                        for parameter in model.parameters():
                            parameter.mul_(1.5)
    finally:
        proof.close()
    return proof


def test_both_paths_write_the_same_transcript_byte_for_byte(tmp_path: Path) -> None:
    host = _run(tmp_path / "host", "host")
    device = _run(tmp_path / "device", "device")
    assert (host.commitments, device.commitments) == ("host", "device")
    report = verify_transcript(tmp_path / "device")
    assert report.ok and report.checks == 4, report.summary()
    comparison = filecmp.dircmp(tmp_path / "host", tmp_path / "device")
    files = ["records.cborl", "probes.bin", "program.bin"]
    assert filecmp.cmpfiles(tmp_path / "host", tmp_path / "device", files, shallow=False) == (
        files,
        [],
        [],
    )
    snapshots = sorted(path.name for path in (tmp_path / "host" / "files").iterdir())
    # Every batch and every step's computed values (gradient), three trees per snapshot.
    assert len(snapshots) == 2 * STEPS + 3 * 3
    assert filecmp.cmpfiles(
        tmp_path / "host" / "files", tmp_path / "device" / "files", snapshots, shallow=False
    ) == (snapshots, [], [])
    assert not comparison.left_only and not comparison.right_only
    # And the platform replays the device run, as any other.
    verdict = torch_replay.verify_challenge(tmp_path / "device", 3, through=5)
    assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_a_step_reads_back_the_record_not_the_state(tmp_path: Path) -> None:
    """On the device path a non-snapshot step reads O(record), on the host path O(state)."""
    device = _run(tmp_path / "device", "device", width=512, probe_ratio=0.05)
    host = _run(tmp_path / "host", "host", width=512, probe_ratio=0.05)
    state = host.transfers.step(4)["state"]  # params, Adam's two moments, BN buffers
    assert state > 50_000
    gradient = host.transfers.step(4)["gradient"]  # the step's computed values
    for step in (1, 2, 4, 5):  # not a snapshot step (0, 3, 6)
        read = device.transfers.step(step)
        assert "state" not in read and "snapshot" not in read
        assert set(read) <= {"batch", "roots", "probes", "values", "gradient"}
        # The gradient file the platform's replay reads is the one O(parameters) read;
        # the rest is four roots per leaf and four probes.
        assert read["gradient"] == gradient < state / 2
        assert sum(read.values()) - gradient < state / 10, read
    # What a step reads back does not grow with the state: 32 bytes a leaf, and probes
    # whose rows are capped.
    small = _run(tmp_path / "small", "device", width=16, probe_ratio=0.05)
    assert device.transfers.step(4)["roots"] == small.transfers.step(4)["roots"]


def test_a_tampered_step_fails_its_check_on_the_device_path(tmp_path: Path) -> None:
    with pytest.raises(zkdv.ZKDVPoisonedError, match="sampled check of step 4 failed"):
        _run(tmp_path / "proof", "device", tamper=True)


def test_auto_keeps_the_host_on_a_cpu(tmp_path: Path) -> None:
    assert _run(tmp_path / "proof", "auto").commitments == "host"
