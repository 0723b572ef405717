"""Exact where the replay can be exact, bounds only where its environment differs.

An honest run of ``test_jax_replay``'s MLP, replayed in its own replay environment, is
judged ``exact``. A recomputed gradient one ulp away from the committed one in one
coordinate at step 4 (a forger's smallest push, seen from the replay's side: the
comparison is symmetric) is rejected there, and accepted within the gradient bounds
when the replay is judged as one elsewhere. Under another CPU kernel family (a fresh
process with ``--xla_cpu_max_isa=SSE4_2``, a genuinely different environment, as the
cross-hardware tests make one) the prover chooses the bounds itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sources import AGENT_PYTHONPATH

pytest.importorskip("jax")
pytest.importorskip("flax")

import numpy as np

from provers import jax_replay
from tests.provers.test_jax_replay import _train
from zkdv.verify import verify_transcript

ROOT = Path(__file__).resolve().parents[2]


def _one_ulp_off(transition: Any) -> Any:
    """The transition, its recomputed gradient at step 4 one ulp larger in one coordinate."""
    compute = transition.compute

    def off(params: Any, opt_state: Any, buffers: Any, batch: Any, record: Any) -> Any:
        leaves = compute(params, opt_state, buffers, batch, record)
        if record["i"] != 4:
            return leaves
        (name, first), *rest = leaves
        first = np.array(first, copy=True)
        flat = first.reshape(-1)
        flat[0] = np.nextafter(flat[0], np.float32(np.inf), dtype=np.float32)
        return [(name, first), *rest]

    return dataclasses.replace(transition, compute=off)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"honest": _train(tmp_path_factory.mktemp("judgement") / "honest")}


def test_an_honest_run_replayed_in_its_own_environment_is_judged_exact(
    runs: dict[str, Path],
) -> None:
    verdict = jax_replay.verify_challenge(runs["honest"], 3, through=5)
    assert verdict.ok, verdict.message
    assert (verdict.judgement, verdict.differences) == ("exact", [])
    assert all(e.exact for e in verdict.evidence)
    assert verdict.to_dict()["judgement"] == "exact"


def test_one_ulp_is_rejected_when_exact_and_accepted_within_bounds_elsewhere(
    runs: dict[str, Path],
) -> None:
    path = runs["honest"]
    transition = _one_ulp_off(jax_replay.load_transition(path))
    verdict = jax_replay.verify_challenge(path, 3, through=5, transition=transition)
    assert (verdict.ok, verdict.reason, verdict.judgement) == (False, "replay_mismatch", "exact")
    assert str(verdict.message).startswith("step 4: the recomputed gradient is not the committed")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    # The same difference, judged as a worker elsewhere judges it: inside the bounds.
    loose = jax_replay.verify_challenge(path, 3, through=5, transition=transition, exact=False)
    assert loose.ok, loose.message
    assert loose.judgement == "within_bounds"
    step4 = loose.evidence[1]
    assert step4.step == 4 and not step4.exact and 0 < step4.gradient["margin"] < 0.01
    assert [e.exact for e in loose.evidence] == [True, False, True]


_REPLAY = """
import json, sys
from provers import jax_replay
out = {}
for argument in sys.argv[1:]:
    name, path = argument.split("=", 1)
    v = jax_replay.verify_challenge(path, 3, through=5)
    out[name] = {"ok": v.ok, "judgement": v.judgement, "differences": v.differences,
                 "message": v.message, "exact": [e.exact for e in v.evidence]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_under_another_kernel_family_the_replay_is_judged_within_bounds(
    runs: dict[str, Path],
) -> None:
    root = verify_transcript(runs["honest"]).root
    if root["env"]["cpu_isa"] == "SSE4_2":
        pytest.skip("this CPU's best instruction set is the one the other process caps to")
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY, *(f"{name}={path}" for name, path in runs.items())],
        env={
            **os.environ,
            "XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2",
            "PYTHONPATH": os.pathsep.join([AGENT_PYTHONPATH, str(ROOT)]),
        },
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    verdicts = json.loads(done.stdout.strip().splitlines()[-1])
    verdict = verdicts["honest"]
    assert verdict["ok"], verdict["message"]
    assert verdict["judgement"] == "within_bounds"
    assert {"cpu_isa", "xla_flags"} <= set(verdict["differences"]), verdict["differences"]
