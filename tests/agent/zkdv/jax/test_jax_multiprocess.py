"""Two JAX processes (jax.distributed over gloo on CPU): rank 0 owns the transcript.

Each process is a subprocess with two CPU devices, so the global mesh has four devices
across two processes. The parameters and optimizer state are replicated (data
parallelism), the batch is split across processes, and the one transcript rank 0
writes must verify and replay like a single-process one: the run commits its gradient
and the canonical update, and one device here reproduces the state bit for bit (the
gradient within the bounds). A weight nudged by 2**-20 in what rank 0 commits is
rejected.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import provers.jax_replay as jax_replay
from tests.agent.zkdv.jax import multiprocess_runs
from zkdv.replay import Transcript
from zkdv.verify import verify_transcript


@pytest.mark.slow
@pytest.mark.timeout(600)  # multiprocess_runs.train gives its processes 300 s
def test_two_processes_write_one_transcript_that_verifies_and_replays(tmp_path: Path) -> None:
    rank0, rank1 = multiprocess_runs.train(tmp_path, "replicated")
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    # Both processes end with the same state and learn the same transcript digest.
    assert rank0["w2"] == rank1["w2"]
    assert rank0["digest"] == rank1["digest"]
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.digest == rank0["digest"]
    assert report.steps == 5
    assert report.root["env"]["process_count"] == 2
    # The run commits its gradient and the canonical update, as one process does.
    transcript = Transcript.load(tmp_path / "proof")
    assert transcript.grad is not None, "a run over several processes commits its gradient"
    assert transcript.root["env"]["update"]["canonical"], transcript.root["env"]["update"]
    for step in range(5):
        # Replayed here on one device: the state bit for bit (ok demands it), the
        # gradient within the bounds (its reductions ran over four devices).
        verdict = jax_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok, (step, verdict.reason, verdict.message)
        assert verdict.judgement in ("exact", "within_bounds"), verdict.judgement
    # The committed batch is the global one: 4 rows from each process.
    from zkdv.files import batch_path, read_batch

    assert read_batch(batch_path(tmp_path / "proof", 0)).shape[0] == 8
    # The platform's prover replays a step and a window from what rank 0 wrote.
    import provers

    verdict = provers.verify_challenge(tmp_path / "proof", 4)
    assert verdict.ok, (verdict.message, verdict.evidence)
    window = provers.verify_challenge(tmp_path / "proof", 0, through=2)
    assert window.ok, window


@pytest.mark.slow
@pytest.mark.timeout(600)  # multiprocess_runs.train gives its processes 300 s
def test_state_split_across_processes_is_rejected_on_every_process(tmp_path: Path) -> None:
    results = multiprocess_runs.train(tmp_path, "split")
    for result in results:
        message = str(result.get("error", ""))
        assert "split across processes" in message and "w1" in message, result


@pytest.mark.slow
@pytest.mark.timeout(600)  # multiprocess_runs.train gives its processes 300 s
def test_a_nudged_update_committed_by_rank_0_is_rejected_by_the_replay(tmp_path: Path) -> None:
    rank0, rank1 = multiprocess_runs.train(tmp_path, "forged")
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    # The processes trained alike; only what rank 0 committed after step 3 was changed.
    assert rank0["w2"] == rank1["w2"]
    for step in range(3):
        verdict = jax_replay.verify_challenge(tmp_path / "proof", step)
        assert verdict.ok, (step, verdict.reason, verdict.message)
    # 2**-20 is far inside the gradient bounds; the committed state must be exact.
    verdict = jax_replay.verify_challenge(tmp_path / "proof", 3)
    assert not verdict.ok and verdict.reason == "replay_mismatch", verdict
