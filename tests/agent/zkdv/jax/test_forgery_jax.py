"""The forgery suite's attacks on the JAX LM recipe (``bench/forgery_suite.py --recipe
jax``) at one fixed seed: each caught, by what ``docs/soundness.md`` says catches it.

One run of each attack, 24 steps (two snapshot windows), the default sampling policy,
20 platform draws per run. The full sweep (3 seeds, 96 steps, 400 draws) is the bench's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.agent.zkdv.torch.test_forgery_suite import _suite

STEPS = 24
DRAWS = 20
ATTACKS = ["substitution-5", "hidden-steps", "tokens-underreported"]

# The module's fixture trains and forges every attack's runs, charged to the first test:
# 44 to 62 s in CI, 180 s on two cores busy with other work.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    suite = _suite()
    work = tmp_path_factory.mktemp("forgeries-jax")
    return suite.run_jax_suite(  # type: ignore[no-any-return]
        ATTACKS, trials=1, draws=DRAWS, steps=STEPS, seed=0, work=work
    )


@pytest.mark.slow
@pytest.mark.long  # the Torch recipe's forgeries run by default (test_forgery_suite.py)
def test_substituted_batches_are_caught_by_the_platform_replay(results: dict[str, Any]) -> None:
    # 2 of 24 steps, both at the end of a snapshot window: only a challenge of that very
    # step replays it, and at 24 steps the platform challenges 23 of them.
    result = results["substitution-5"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert set(result.by) <= {"platform replay", "sampled check"}
    assert set(result.steps_caught) <= {11, 23}


@pytest.mark.slow
@pytest.mark.long  # the Torch recipe's forgeries run by default (test_forgery_suite.py)
def test_steps_trained_off_the_transcript_break_continuity(results: dict[str, Any]) -> None:
    # The forger's SDK skips its own continuity refusal; the verifier's probes see it.
    result = results["hidden-steps"]
    assert result.by == {"verifier: probe_discontinuity": DRAWS}


@pytest.mark.slow
@pytest.mark.long  # the Torch recipe's forgeries run by default (test_forgery_suite.py)
def test_an_underreported_token_count_is_caught_at_the_first_replay(
    results: dict[str, Any],
) -> None:
    result = results["tokens-underreported"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert result.by == {"platform replay": DRAWS}
    assert result.extra["committed / real tokens"] == [0.5]


def test_the_unmodified_sdk_refuses_a_step_trained_off_the_transcript(tmp_path: Path) -> None:
    # Without the forger's change the SDK itself stops the run at the next step.
    step_of = _suite()._step_of
    from bench import _forgery_jax as forgery_jax

    forger = forgery_jax.JaxForger(hidden_after=frozenset({2}))
    original = forgery_jax._modified_sdk

    def honest_sdk(forger: Any, committed: Any) -> Any:
        return original(forgery_jax.JaxForger(), committed)

    forgery_jax._modified_sdk = honest_sdk  # type: ignore[assignment]
    try:
        run = forgery_jax.train(tmp_path / "p", steps=5, seed=0, forger=forger, step_of=step_of)
    finally:
        forgery_jax._modified_sdk = original  # type: ignore[assignment]
    assert (run.poisoned_at, run.refused_by) == (3, "SDK: continuity")
