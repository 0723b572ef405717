"""The run's drift test where its verdict is formed (``verdicts.run_drift``) and on its
certificate (``platforms.drift``): every passed challenge's window, each once."""

from __future__ import annotations

from typing import Any

import numpy as np

from attestations.certificates import platforms
from attestations.challenges.models import Challenge, ChallengeStatus
from attestations.challenges.verdicts import run_drift


def _window(first: int, signs: list[float], status: str = ChallengeStatus.PASSED) -> Challenge:
    e = np.array(signs)
    gram = 0.5 * np.outer(e, e)
    np.fill_diagonal(gram, 1.0)
    drift: dict[str, Any] = {
        "first": first,
        "last": first + len(signs) - 1,
        "inexact_steps": len(signs),
        "z": 1.0,
        "p": 1.0,
        "window_p": 1e-6,
        "cosine": 0.5,
        "steps": list(range(first, first + len(signs))),
        "gram": gram.tolist(),
    }
    return Challenge(step=first + len(signs) - 1, status=status, evidence={"drift": drift})


def test_windows_that_align_in_every_pair_reject_the_run_and_honest_ones_do_not() -> None:
    aligned = [_window(first, [1.0] * 12) for first in (0, 12)]
    verdict = run_drift(aligned)
    assert verdict["exceeded"] and verdict["p"] <= 1e-6 and verdict["windows"] == [0, 12]
    # A failed challenge's window is the failure's business, not the run test's.
    assert not run_drift([aligned[0], _window(12, [1.0] * 12, ChallengeStatus.FAILED)])["exceeded"]
    rng = np.random.default_rng(0)
    mixed = [_window(12 * w, list(rng.choice((1.0, -1.0), 12))) for w in range(8)]
    assert not run_drift(mixed)["exceeded"]


def test_the_certificate_states_each_window_once_and_the_run() -> None:
    challenges = [_window(0, [1.0] * 12), _window(0, [1.0] * 5), _window(12, [1.0] * 12)]
    rows = [(c.step, None, c.status, c.evidence) for c in challenges]
    stated = platforms.drift(rows)
    assert stated is not None
    assert [(w["first"], w["last"]) for w in stated["windows"]] == [(0, 11), (12, 23)]
    assert stated["run"]["exceeded"]
    assert platforms.drift([]) is None
