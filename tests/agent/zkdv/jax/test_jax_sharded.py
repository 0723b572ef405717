"""A step sharded over the devices of one process commits its gradient (issue 56).

Eight CPU devices in a subprocess (``--xla_force_host_platform_device_count=8``), on
XLA's AVX2 kernels: an MLP with clipping and AdamW on a warmup-cosine schedule, its
batch split over the ``data`` axis and its hidden layer over the ``model`` axis, trained
on three meshes (8x1, 4x2, 2x4): ``recipes.sharded``, the recipe the cross-hardware
sweep trains under other instruction sets. XLA partitions the step and the canonical update alike.
Each run is then replayed here, on one device and this CPU's own kernels: the gradient
within the bounds (its reductions ran in another order), the state bit for bit (the
canonical update does not depend on the partitioning), every step. A forger's run whose
step 3 commits a gradient 1 % larger than the one its optimizer applied is rejected at
step 3.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import provers.jax_replay as jax_replay
from tests.processes import run_jax
from zkdv.replay import Transcript
from zkdv.verify import verify_transcript

HERE = str(Path(__file__).resolve().parent)  # recipes.py's folder
MESHES = ((8, 1), (4, 2), (2, 4))
STEPS = 5

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[4])
    import recipes, zkdv

    out = {}
    for data, model in json.loads(sys.argv[2]):
        proof = zkdv.jax.ZKDV(
            f"{sys.argv[1]}/{data}x{model}",
            zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(2)),
            replay_snapshot_interval=2,
        )
        proof.start(rolling_window=2)
        out[f"{data}x{model}"] = recipes.sharded(proof, int(sys.argv[3]), mesh=(data, model))
        proof.close()
    # A forger's 2x4 run: no SDK checks, and step 3 commits a gradient 1 % larger than
    # the one its optimizer applied.
    forger = zkdv.jax.ZKDV(
        f"{sys.argv[1]}/forged",
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=2,
    )
    forger.start(rolling_window=2)
    recipes.forge(forger, step=3)
    recipes.sharded(forger, int(sys.argv[3]), mesh=(2, 4))
    forger.close()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sharded")
    script = where / "train.py"
    script.write_text(SCRIPT)
    output = run_jax(
        [script, where, json.dumps(MESHES), STEPS, HERE],
        folder=where,
        name="train",
        xla_flags="--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2",
    )
    kept = json.loads(output.strip().splitlines()[-1])
    assert kept == {f"{d}x{m}": True for d, m in MESHES}, "a leaf lost its layout"
    return where


@pytest.mark.slow
@pytest.mark.timeout(600)  # the training subprocess has 420 s
@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_a_sharded_run_commits_its_gradient_and_replays_on_one_device(
    runs: Path, mesh: str
) -> None:
    path = runs / mesh
    report = verify_transcript(path)
    assert report.ok, report.summary()
    transcript = Transcript.load(path)
    assert transcript.grad is not None, "a sharded step commits its gradient"
    assert transcript.root["env"]["update"]["canonical"], transcript.root["env"]["update"]
    sharding = transcript.root["schema"]["sharding"]["params"]
    data, model = (int(n) for n in mesh.split("x"))
    assert {"data": data, "model": model} == sharding[0]["mesh"]
    for step in range(STEPS):
        verdict = jax_replay.verify_challenge(path, step)
        # The state bit for bit (ok demands it), the gradient within the bounds.
        assert verdict.ok, (step, verdict.reason, verdict.message)
        assert verdict.judgement == "within_bounds", verdict.judgement


def test_the_meshes_commit_one_initial_state_and_one_layout(runs: Path) -> None:
    roots = {
        repr(sorted(Transcript.load(runs / f"{d}x{m}").root["initial"].items())) for d, m in MESHES
    }
    assert len(roots) == 1, "the transcript commits the global arrays, whatever the mesh"


@pytest.mark.slow
@pytest.mark.timeout(600)  # the training subprocess has 420 s
def test_a_committed_gradient_one_percent_larger_is_caught_on_one_device(runs: Path) -> None:
    path = runs / "forged"
    assert verify_transcript(path).ok  # its roots, gradient file and probes agree
    # As a worker on other hardware judges it: the bounds, not bit for bit.
    verdict = jax_replay.verify_challenge(path, 2, through=3, exact=False)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch"), verdict
    assert str(verdict.message).startswith("step 3: the recomputed values differ"), verdict
    assert [(e.step, e.ok) for e in verdict.evidence] == [(2, True), (3, False)]
    assert verdict.evidence[-1].gradient is not None
    assert verdict.evidence[-1].gradient["margin"] > 1
    assert jax_replay.verify_challenge(path, 0, through=1, exact=False).ok
