"""The shared Driver pipeline, exercised by a minimal numpy frontend (no framework)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import zkdv
from tests.synthetic import LinearSGD
from zkdv.driver import Driver, ReplayOutcome, Submission
from zkdv.files import read_batch, read_state, snapshot_path
from zkdv.records import iter_records
from zkdv.sampling import Challenge
from zkdv.verify import verify_transcript


def _leaves(tree: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    return [(k, tree[k]) for k in sorted(tree)]


def _flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([tree[k].reshape(-1).astype(np.float64) for k in sorted(tree)])


class NumpyProof(Driver):
    """A toy frontend: one LinearSGD step per call, replayed exactly from snapshots."""

    def __init__(self, path: Path, config: zkdv.ZKDVConfig, **options: int) -> None:
        super().__init__(
            path,
            config,
            backend="jax",
            max_in_flight=options.get("max_in_flight", 2),
            replay_snapshot_interval=options.get("interval", 3),
        )
        self.model = LinearSGD(4)
        # Snapshots by step: a check completes asynchronously, possibly after a newer
        # snapshot was taken, so it must replay from the one that precedes its step.
        self.snapshots: dict[int, tuple[dict, dict]] = {}
        self.inputs: dict[int, np.ndarray] = {}
        self.tamper_step: int | None = None

    def step(self, params: dict, state: dict, batch: np.ndarray, policy=zkdv.overlap.UNCHECKED):
        with self._admit(policy) as admission:
            index = self.steps
            deltas, new_params, new_state = self.model.update(params, state, batch)
            if index == self.tamper_step:  # an update that differs from the program
                deltas = {k: v * 2 for k, v in deltas.items()}
                new_params = {k: params[k] + deltas[k] for k in params}
            sub = _Step(self, index, params, state, batch, deltas, new_params, new_state, policy)
            if self._snapshot_due(index):
                self.snapshots[index] = (dict(params), dict(state))
                sub.snapshot = (_leaves(params), _leaves(state), [])
            self.inputs[index] = batch
            self._submit(admission, sub)
        return new_params, new_state


class _Step(Submission):
    def __init__(self, proof, index, params, state, batch, deltas, new_params, new_state, policy):
        self.proof, self.index, self.policy = proof, index, policy
        self.pre, self.pre_state, self.data = params, state, batch
        self.deltas, self.params, self.state = deltas, new_params, new_state

    def initial_state(self):
        return _leaves(self.pre), _leaves(self.pre_state), []

    def batch(self):
        return self.data

    def post_state(self):
        return _leaves(self.params), _leaves(self.state), []

    def probes(self, probes):
        project = lambda tree: probes.project_all([a for _, a in _leaves(tree)])  # noqa: E731
        return project(self.pre), project(self.params), project(self.deltas)

    def capture(self, c: Challenge):
        return float(_flat(self.deltas)[c.param_index]), float(_flat(self.state)[c.state_index])

    def replay(self, c: Challenge) -> ReplayOutcome:
        start = c.step - c.step % self.proof.replay_snapshot_interval
        params, state = self.proof.snapshots[start]
        for step in range(start, c.step):
            _, params, state = self.proof.model.update(params, state, self.proof.inputs[step])
        deltas, _, post_state = self.proof.model.update(params, state, self.proof.inputs[c.step])
        return ReplayOutcome(
            float(_flat(deltas)[c.param_index]),
            float(_flat(post_state)[c.state_index]),
            start,
            c.step - start,
        )


EVERY_STEP = zkdv.SamplingPolicy.DEBUGCheckEvery(1)


def _batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 1000, (8, 5), dtype=np.uint32) for _ in range(n)]


def _run(tmp_path: Path, policy=EVERY_STEP, *, tamper=None, steps=7, **opts):
    proof = NumpyProof(
        tmp_path / "proof", zkdv.ZKDVConfig(sampling_policy=policy, chunk_bytes=64), **opts
    )
    proof.tamper_step = tamper
    proof.start(rolling_window=3, probe_ratio=0.5)
    params, state = proof.model.init(0)
    try:
        for batch in _batches(steps):
            params, state = proof.step(params, state, batch)
    except zkdv.ZKDVPoisonedError:
        # A failed check poisons subsequent operations as soon as it completes;
        # close() always observes it (asserted by the callers).
        assert tamper is not None
    return proof, params, state


def test_honest_run_verifies_and_keeps_replay_files(tmp_path: Path) -> None:
    proof, _, _ = _run(tmp_path)
    proof.close()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert (report.steps, report.checks) == (7, 7)
    assert report.snapshots == [0, 3, 6]
    assert report.digest == proof.digest.hex()
    # Snapshot files hash back to the roots the transcript committed.
    root = report.root
    specs = [zkdv.merkle.LeafSpec.from_dict(s) for s in root["schema"]["params"]]
    _, commitment = read_state(snapshot_path(tmp_path / "proof", 0, "params"), specs, 64)
    assert commitment.root == root["initial"]["p"]
    assert read_batch(tmp_path / "proof" / "files" / "batch-00000006.u32").shape == (8, 5)


def test_update_that_differs_from_the_program_poisons_close(tmp_path: Path) -> None:
    proof, *_ = _run(tmp_path, tamper=4)
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        proof.close()
    assert isinstance(raised.value.__cause__, zkdv.ZKDVVerificationError)
    assert "step 4" in str(raised.value.__cause__)
    with pytest.raises(zkdv.ZKDVPoisonedError):
        proof.close()  # safe to call again: it reports the same failure
    report = verify_transcript(tmp_path / "proof")
    assert (report.ok, report.reason) == (False, "failed_check")


def test_poison_surfaces_at_the_next_step(tmp_path: Path) -> None:
    proof, params, state = _run(tmp_path, tamper=1, steps=2)
    with pytest.raises(zkdv.ZKDVPoisonedError):
        for batch in _batches(20):
            params, state = proof.step(params, state, batch)
    with pytest.raises(zkdv.ZKDVPoisonedError):
        proof.close()


@pytest.mark.parametrize(
    ("policy", "bound"),
    [(zkdv.overlap.NEVER, 1), (zkdv.overlap.UNCHECKED, 2), (zkdv.overlap.ALWAYS, 2)],
)
def test_overlap_policies_bound_live_generations(tmp_path: Path, policy, bound) -> None:
    proof = NumpyProof(
        tmp_path / "p",
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(2), chunk_bytes=64),
    )
    proof.start(rolling_window=2)
    params, state = proof.model.init(1)
    for batch in _batches(12):
        params, state = proof.step(params, state, batch, policy)
    proof.close()
    assert proof._queue.max_live <= bound
    assert verify_transcript(tmp_path / "p").ok


def test_lifecycle_errors_say_what_to_do(tmp_path: Path) -> None:
    proof = NumpyProof(tmp_path / "p", zkdv.ZKDVConfig())
    params, state = proof.model.init(0)
    with pytest.raises(zkdv.ZKDVError, match=r"call proof.start"):
        proof.step(params, state, _batches(1)[0])
    proof.start(rolling_window=2)
    with pytest.raises(zkdv.ZKDVError, match="already started"):
        proof.start(rolling_window=2)
    proof.close()
    bad = NumpyProof(tmp_path / "q", zkdv.ZKDVConfig())
    bad.start(rolling_window=9)
    bad.step(params, state, _batches(1)[0])
    with pytest.raises(zkdv.ZKDVPoisonedError) as raised:
        bad.close()
    assert "rolling_window=9 exceeds the committed batch row width of 5" in str(raised.value)
    with pytest.raises(zkdv.ZKDVError, match="closed"):
        proof.step(params, state, _batches(1)[0])


def test_steps_never_wait_for_the_transcript_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes and fsyncs leave the commit stage: training goes on while the disk stalls.

    The writer thread is held at its first fsync (the root record's); seven steps still
    complete, their records and batch files wait in the writer's bounded queue, and
    ``close()`` writes them all, in order.
    """
    from zkdv.records import RECORDS_FILE, TranscriptWriter

    gate = threading.Event()
    original = TranscriptWriter._fsync

    def stalled(writer: TranscriptWriter) -> None:
        gate.wait()
        original(writer)

    monkeypatch.setattr(TranscriptWriter, "_fsync", stalled)
    finished = threading.Event()
    outcome: list[object] = []

    def train() -> None:
        try:
            outcome.append(_run(tmp_path, zkdv.SamplingPolicy(update_check_probability=0.0)))
        finally:
            finished.set()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        # Not a timing assertion: without the change the steps wait for the gate forever.
        assert finished.wait(120), "a training step waited for the stalled disk"
        proof = outcome[0][0]  # type: ignore[index]
        assert proof.steps == 7
        # Nothing but the root record reached the file while training ran.
        assert len(list(iter_records(tmp_path / "proof" / RECORDS_FILE))) == 1
        assert not (tmp_path / "proof" / "files" / "batch-00000000.u32").exists()
    finally:
        gate.set()
        thread.join()
    proof.close()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.steps == 7
    assert read_batch(tmp_path / "proof" / "files" / "batch-00000006.u32").shape == (8, 5)
