"""The forgery suite (``bench/forgery_suite.py``) at one fixed seed: each family caught, or
its limitation measured exactly as ``docs/soundness.md`` states it.

One run of each attack on the LM recipe, 24 steps (two snapshot windows), the default
sampling policy, 20 platform draws per run. The full sweep (more seeds, 96 steps, every
attack) is the bench's; its tables are in ``docs/soundness.md``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[4]
STEPS = 24
DRAWS = 20
ATTACKS = [
    "tolerance-gap",  # (a)
    "substitution-5",  # (b)
    "hidden-steps",  # (c)
    "tokens-underreported",  # (c)
    "flops-underreported",  # (c)
    "pol-interpolation",  # (d)
]
#: The platform's replay, or the SDK's own sampled check when its draw (which follows
#: the records' hashes, timestamps included) lands on a forged step first.
CAUGHT_BY_A_CHECK = {"platform replay", "sampled check"}
# The module's fixture trains and forges every attack's runs, charged to the first test:
# 32 to 44 s in CI, several times that on a busy machine.
pytestmark = pytest.mark.timeout(600)


def _suite() -> ModuleType:
    path = REPO_ROOT / "bench" / "forgery_suite.py"
    spec = importlib.util.spec_from_file_location("forgery_suite", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    suite = _suite()
    work = tmp_path_factory.mktemp("forgeries")
    # No warm-up run: the costs it keeps honest are not asserted here.
    return suite.run_suite(  # type: ignore[no-any-return]
        ATTACKS, trials=1, draws=DRAWS, steps=STEPS, seed=0, work=work, warm_up=False
    )


@pytest.mark.slow
def test_substituted_batches_are_caught_by_the_platform_replay(results: dict[str, Any]) -> None:
    # 2 of 24 steps, both at the end of a snapshot window: only a challenge of that very
    # step replays it, and at 24 steps the platform challenges 23 of them.
    result = results["substitution-5"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert set(result.by) <= CAUGHT_BY_A_CHECK
    assert set(result.steps_caught) <= {11, 23}


@pytest.mark.slow
def test_steps_trained_off_the_transcript_break_continuity(results: dict[str, Any]) -> None:
    result = results["hidden-steps"]
    assert result.by == {"verifier: probe_discontinuity": DRAWS}


@pytest.mark.slow
def test_a_proof_of_learning_spoof_fails_its_first_challenged_step(results: dict[str, Any]) -> None:
    result = results["pol-interpolation"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert set(result.by) <= CAUGHT_BY_A_CHECK
    if result.by == {"platform replay": DRAWS}:
        assert set(result.steps_caught) == {1}  # the first spoofed step; step 0 was honest


@pytest.mark.slow
def test_the_tolerance_gap_forger_passes_the_bounds_but_not_the_drift_test(
    results: dict[str, Any],
) -> None:
    # docs/soundness.md (a): within the reduced-precision bounds every step passes the
    # bounds of a replay on other hardware, but its pushes keep one direction, so the
    # run's drift test (provers.drift) over its two windows rejects it: a draw of 23 of
    # 24 steps replays both windows (nearly) whole.
    result = results["tolerance-gap"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert result.by == {"platform: the run's drift test": DRAWS}
    assert result.exact_caught == DRAWS
    extra = {key: values[0] for key, values in result.extra.items()}
    assert 0.9 < extra["worst replay margin"] <= 0.95 + 1e-6
    assert extra["drift: mean cosine of the pushes in a window"] > 0.1
    # What it would have planted, had no replay looked across steps: 0.125 here (64 of
    # 512 triggered inputs) at this seed and length; another CPU's kernels move the
    # trajectory a little, so the bar is 10 of 512, still none honest.
    assert extra["backdoor success, honest"] == 0.0
    assert extra["backdoor success, forged"] >= 10 / 512
    assert abs(extra["clean loss, forged"] - extra["clean loss, honest"]) < 0.05


@pytest.mark.slow
def test_an_underreported_token_count_is_caught_at_the_first_replay(
    results: dict[str, Any],
) -> None:
    # Every replay recounts every step record against the batch the committed program
    # takes (tokens_mismatch), so whichever step a draw challenges, the claim is caught.
    result = results["tokens-underreported"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert result.by == {"platform replay": DRAWS}
    assert result.extra["committed / real tokens"] == [0.5]


@pytest.mark.slow
def test_an_underreported_flop_count_is_caught_at_the_first_replay(
    results: dict[str, Any],
) -> None:
    # Every replay recounts every step record's FLOPs with Torch's FLOP counter on the
    # committed program (flops_mismatch): half the count is caught whatever is drawn.
    result = results["flops-underreported"]
    assert (result.caught, result.trials) == (DRAWS, DRAWS)
    assert result.by == {"platform replay": DRAWS}
    assert result.extra["committed / real FLOPs"] == [0.5]


def test_the_soundness_page_is_rewritten_by_one_command_and_covers_every_attack() -> None:
    suite = _suite()
    page = (REPO_ROOT / "docs" / "soundness.md").read_text()
    blocks = suite.doc_blocks(page)
    named = {
        recipe: {a for r, attacks in blocks if r == recipe for a in attacks}
        for recipe in ("torch", "jax")
    }
    from bench import _forgery_jax as forgery_jax

    # One table row for every attack of either recipe.
    assert named["torch"] == set(suite.ATTACKS)
    assert named["jax"] == set(forgery_jax.ATTACKS)

    caught = suite.Result("substitution-1", runs=1, trials=4, caught=3, forged_steps=1)
    caught.by = {"platform replay": 3}
    caught.note("a measure", 0.5)
    missed = suite.Result("hidden-steps", runs=1, trials=4, caught=0)
    text = (
        "prose before\n"
        "<!-- forgery-suite --recipe torch --attacks substitution-1 -->\nold table\n"
        "<!-- /forgery-suite -->\nprose between\n"
        "<!-- forgery-suite --recipe jax --attacks hidden-steps -->\nold\n"
        "<!-- /forgery-suite -->\n"
        "<!-- forgery-suite-run -->\nold run\n<!-- /forgery-suite-run -->\nprose after\n"
    )
    results = {"torch": {"substitution-1": caught}, "jax": {"hidden-steps": missed}}
    rendered = suite.render_docs(text, results, 24, "the new run")
    assert rendered.startswith("prose before\n<!-- forgery-suite --recipe torch")
    assert "old" not in rendered
    assert "| substitution-1 | 1 of 24 | 1 x 4 | 0.750 [" in rendered
    assert "| substitution-1 | a measure | 0.5 |" in rendered
    assert "| hidden-steps | 0 of 24 | 1 x 4 | 0.000 [" in rendered
    assert "\nprose between\n" in rendered and rendered.endswith("prose after\n")
    assert "<!-- forgery-suite-run -->\nthe new run\n<!-- /forgery-suite-run -->" in rendered
    # Rendering again changes nothing: the markers survive.
    assert suite.render_docs(rendered, results, 24, "the new run") == rendered


def test_the_adaptive_forgers_push_on_the_schedules_they_are_named_for() -> None:
    suite = _suite()
    steps = range(96)

    def pattern(attack: str, seed: int = 0) -> list[float]:
        return [suite.ADAPTIVE[attack][1](seed, index) for index in steps]

    # Every step pushes, towards the backdoor with probability q: 90, 75, 60 of 100.
    for q in (90, 75, 60):
        signs = [s for seed in range(20) for s in pattern(f"tolerance-gap-biased-{q}", seed)]
        assert set(signs) == {1.0, -1.0}
        assert abs(signs.count(1.0) / len(signs) - q / 100) < 0.04
    assert pattern("tolerance-gap-biased-75", 0) != pattern("tolerance-gap-biased-75", 1)
    # One step in k, the late ones of a window; one push per snapshot window for spread.
    for k in (2, 3, 6):
        pushed = [i for i, s in zip(steps, pattern(f"tolerance-gap-every-{k}"), strict=True) if s]
        assert pushed == list(range(k - 1, 96, k))
    spread = [i for i, s in zip(steps, pattern("tolerance-gap-spread"), strict=True) if s]
    assert spread == list(range(11, 96, 12))
    assert {i // suite.SNAPSHOT_INTERVAL for i in spread} == set(range(8))
    # Fewer pushes buy no larger one: the bound is per step.
    assert suite.ADAPTIVE["tolerance-gap-every-2"][0] == suite.PER_STEP_CAP < 1.0
    assert [suite.ADAPTIVE[f"tolerance-gap-scaled-{s}"][0] for s in (50, 25, 10)] == [
        pytest.approx(0.95 * s / 100) for s in (50, 25, 10)
    ]
    assert set(suite.ADAPTIVE) <= suite.UNDETECTABLE_BY_REPLAY


def test_the_best_undetected_effect_is_the_largest_backdoor_below_each_detection_level() -> None:
    suite = _suite()

    def result(attack: str, caught: int, backdoor: float) -> Any:
        r = suite.Result(attack, runs=1, trials=100, caught=caught)
        r.note("backdoor success, forged", backdoor)
        r.missed_distance = [0.1] * (100 - caught)
        return r

    results = {
        "caught": result("caught", 100, 0.9),  # planted most, always caught: not counted
        "partly": result("partly", 60, 0.3),
        "never": result("never", 2, 0.1),
        "never-none": result("never-none", 0, 0.0),
    }
    assert suite.best_undetected(results, 0.95).attack == "partly"
    assert suite.best_undetected(results, 0.05).attack == "never"
    assert suite.best_undetected({"caught": results["caught"]}, 0.95) is None
    text = suite.best_text(results)
    assert "`partly`, backdoor success **0.300**" in text
    assert "`never`, backdoor success **0.100**" in text
    assert "caught in 0.600 [" in text


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    suite = _suite()
    work = tmp_path_factory.mktemp("adaptive")
    return suite.run_suite(  # type: ignore[no-any-return]
        ["tolerance-gap-spread", "tolerance-gap-every-2"],
        trials=1, draws=DRAWS, steps=STEPS, seed=0, work=work, warm_up=False,
    )  # fmt: skip


@pytest.mark.slow
def test_a_forger_that_spreads_its_pushes_over_windows_gives_the_drift_test_no_pair(
    adaptive: dict[str, Any],
) -> None:
    # Trains three 24-step runs (honest, two forgers): about 40 s on two shared cores.
    spread = adaptive["tolerance-gap-spread"]
    extra = {key: values[0] for key, values in spread.extra.items()}
    assert spread.forged_steps == 2  # steps 11 and 23, one per window
    assert spread.caught == 0 and spread.exact_caught == DRAWS
    # Each window replays one push: the drift test has no pair of steps to look at.
    assert extra["drift: most inexact steps in a window"] == 1
    assert "drift: mean cosine of the pushes in a window" not in extra
    assert 0.97 < extra["worst replay margin"] <= 0.98 + 1e-6
    assert extra["net push, share of the every-step forger's"] == pytest.approx(0.98 / 0.95 / 12)
    # Every second step pushes: six aligned pushes in each window of 12, which the drift
    # statistic sees (but two windows of six do not reach the run's threshold).
    every = adaptive["tolerance-gap-every-2"]
    extra = {key: values[0] for key, values in every.extra.items()}
    assert every.forged_steps == 12
    assert extra["drift: most inexact steps in a window"] == 6
    assert extra["drift: mean cosine of the pushes in a window"] > 0.5
    assert every.caught == 0


def test_the_certificate_states_the_best_undetected_effect_the_page_measured() -> None:
    # The certificate's forger budget copies the numbers of docs/soundness.md's "best
    # undetected effect" block, which --update-docs regenerates: they must not drift apart.
    import re

    from attestations.certificates.subjects import MEASURED_UNDETECTED

    page = (REPO_ROOT / "docs" / "soundness.md").read_text()
    block = _suite().DOC_BEST.search(page)
    assert block is not None
    lines = [line for line in block.group(0).splitlines() if line.startswith("* caught")]
    assert len(lines) == 2
    for line in lines:
        found = re.search(r"`([a-z0-9-]+)`, backdoor success \*\*([0-9.]+)\*\*", line)
        assert found is not None, line
        caught = re.search(r"caught in ([0-9.]+) \[", line)
        assert caught is not None, line
        attack, success = found.groups()
        assert f"{attack}, backdoor success {success}" in MEASURED_UNDETECTED
        assert f"caught in {caught.group(1)}" in MEASURED_UNDETECTED
