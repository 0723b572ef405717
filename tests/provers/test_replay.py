"""The framework-neutral replay: honest runs pass, forgeries fail with a precise reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from provers.replay import Transcript, replay, windows
from zkdv.files import batch_path, snapshot_path
from zkdv.testing import LinearSGD, write_synthetic_transcript

FEATURES = 6


def transition(params, opt_state, buffers, batch, step=None):  # type: ignore[no-untyped-def]
    """The attested program of the synthetic runs, as a state transition."""
    model = LinearSGD(FEATURES)
    p, s = dict(params), dict(opt_state)
    deltas, new_p, new_s = model.update(p, s, batch)
    leaves = lambda tree: [(k, tree[k]) for k in sorted(tree)]  # noqa: E731
    return leaves(new_p), leaves(new_s), list(buffers), leaves(deltas)


def _run(tmp_path: Path, forge: str | None = None) -> Path:
    return write_synthetic_transcript(
        tmp_path / (forge or "honest"), steps=8, features=FEATURES, forge=forge, forge_step=3
    )


def test_honest_run_replays_exactly_on_every_window(tmp_path: Path) -> None:
    path = _run(tmp_path)
    transcript = Transcript.load(path)
    assert windows(transcript) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for first, last in windows(transcript):
        verdict = replay(transcript, step=first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert [e.step for e in verdict.evidence] == list(range(first, last + 1))
        assert all(e.exact and e.batch_ok for e in verdict.evidence)


@pytest.mark.parametrize(
    ("forge", "step"),
    [("outside_step", 4), ("batches", 3), ("lr", 3)],
)
def test_forgeries_that_pass_the_offline_verifier_fail_replay(
    tmp_path: Path, forge: str, step: int
) -> None:
    path = _run(tmp_path, forge)
    verdict = replay(path, step=step, transition=transition)
    assert not verdict.ok
    assert verdict.reason == "replay_mismatch"
    assert f"step {step}" in verdict.message
    # Steps before the forgery still replay.
    assert replay(path, step=1, transition=transition).ok


def test_snapshot_that_does_not_hash_to_its_commitment(tmp_path: Path) -> None:
    path = _run(tmp_path)
    file = snapshot_path(path, 4, "params")
    data = bytearray(file.read_bytes())
    data[0] ^= 1
    file.write_bytes(bytes(data))
    verdict = replay(path, step=5, transition=transition)
    assert (verdict.ok, verdict.reason, verdict.snapshot_ok) == (False, "snapshot_mismatch", False)
    assert "snapshot-00000004.params.bin does not hash" in verdict.message


def test_batch_file_that_does_not_hash_to_its_commitment(tmp_path: Path) -> None:
    path = _run(tmp_path)
    file = batch_path(path, 5)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    verdict = replay(path, step=5, transition=transition)
    assert (verdict.reason, verdict.evidence[-1].batch_ok) == ("batch_mismatch", False)


def test_missing_files_are_named(tmp_path: Path) -> None:
    path = _run(tmp_path)
    batch_path(path, 2).unlink()
    verdict = replay(path, step=3, transition=transition)
    assert verdict.reason == "missing_file" and "batch-00000002.u32" in verdict.message


def test_replay_within_tolerance_when_not_bitwise(tmp_path: Path) -> None:
    # A transition that rounds differently (as compiled code does) is judged by probes.
    path = _run(tmp_path)

    def noisy(params, opt_state, buffers, batch, step):  # type: ignore[no-untyped-def]
        p, s, b, d = transition(params, opt_state, buffers, batch, step)
        nudge = lambda leaves: [(k, (v * np.float32(1 + 1e-6)).astype(v.dtype)) for k, v in leaves]  # noqa: E731
        return nudge(p), s, b, d

    verdict = replay(path, step=3, transition=noisy)
    assert verdict.ok, verdict.message
    assert not any(e.exact for e in verdict.evidence)
    assert all(e.probe_excess is not None and e.probe_excess <= 0 for e in verdict.evidence)
