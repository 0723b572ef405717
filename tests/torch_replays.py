"""The platform's replay of a Torch transcript, as the tests of honest runs and forgeries use it."""

from __future__ import annotations

from pathlib import Path

from provers import torch_replay
from provers.replay import Transcript, windows


def replays_every_step_exactly(path: Path) -> None:
    """The platform's replay of every window, bit for bit."""
    transcript = Transcript.load(path)
    assert torch_replay.exact_environment(transcript.root)
    transition = torch_replay.load_transition(path)
    replayed = []
    for first, last in windows(transcript):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert all(evidence.exact for evidence in verdict.evidence)
        replayed += [evidence.step for evidence in verdict.evidence]
    assert replayed == list(range(len(transcript.steps)))


def replay_rejects(path: Path, step: int, *, earliest: int | None = None) -> None:
    """The platform's replay from step 0 through ``step`` rejects the run at ``step``.

    With ``earliest``, at any step from ``earliest`` to ``step``: a state changed right
    after a step may land in that step's post-state commitment, which is hashed while
    the next step runs.
    """
    verdict = torch_replay.verify_challenge(path, 0, through=step)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict.message
    first = step if earliest is None else earliest
    assert any(
        str(verdict.message).startswith(f"step {index}:") for index in range(first, step + 1)
    ), verdict.message
