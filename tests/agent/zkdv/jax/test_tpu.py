"""ZKDV on a TPU: honest recipes train, verify and replay exactly; both commitment paths
write one transcript; the canonical update has the CPU's bits; forgeries are caught.

Skipped where JAX has no TPU (CI has none). Run on a TPU machine, in one process (one
program at a time may hold the chip)::

    python -m pytest -m tpu tests/agent/zkdv/jax/test_tpu.py tests/agent/zkdv/jax/test_device_probes.py

and record the date and result in ``docs/reliability.md`` ("ZKDV on a TPU"). What CPU
CI guards instead: every program the device path and the canonical update build lowers
for ``platforms=("tpu",)`` with no 64-bit type (``test_canonical.py``,
``test_device_probes.py``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import zkdv
from zkdv.verify import verify_transcript

# ZKDV_TEST_TPU_PLATFORM=cpu dry-runs the suite's logic on a CPU (the TPU's claims then
# hold trivially); nothing sets it in CI.
TPU = os.environ.get("ZKDV_TEST_TPU_PLATFORM", "tpu")

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(
        not any(d.platform == TPU for d in jax.devices()), reason="needs a TPU (JAX sees none)"
    ),
]

import recipes  # noqa: E402  (tests/agent/zkdv/jax, on sys.path through its conftest)

STEPS = 16


def _train(tmp_path: Path, name: str, commitments: str) -> Path:
    path = tmp_path / f"{name}-{commitments}"
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            # No sampled checks: their records land when their thread finishes, so two runs
            # would order them differently (the replay below checks the steps instead).
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0),
            commitments=commitments,
        ),
        replay_snapshot_interval=recipes.INTERVAL,
    )
    proof.start(rolling_window=2, probe_ratio=0.25)
    # What a run draws or reads from the clock, fixed so that two runs compare byte for byte.
    assert proof._core is not None
    proof._core.probe_seed = bytes(range(16))
    proof._core.clock = lambda: 1.0
    {**recipes.RECIPES, **recipes.SCANNED}[name](proof, STEPS, 0)
    proof.close()
    return path


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_a_recipe_trains_verifies_and_replays_exactly_on_the_tpu(tmp_path: Path, name: str) -> None:
    import provers.jax_replay as jax_replay
    from zkdv.jax.replay import load_transition

    # One call site for both runs: the exported program's location metadata names it.
    host, device = (_train(tmp_path, name, path) for path in ("host", "device"))
    # The configuration's promise: the transcript does not depend on the path.
    assert (host / "records.cborl").read_bytes() == (device / "records.cborl").read_bytes()
    transcript = verify_transcript(device)
    env = transcript.root["env"]
    assert env["jax_platform"] == TPU
    if TPU == "tpu":
        assert env["devices"][0].startswith("TPU")
    assert jax_replay.exact_environment(transcript.root)
    if TPU == "tpu":
        # A TPU's runs keep no gradient files: the replay recomputes them bit for bit.
        assert transcript.root["config"]["gradient_files"] == "never"
        assert not list((device / "files").glob("grad-*"))
    transition = load_transition(device)
    for step in sorted({0, 3, 4, 7, STEPS // 2, STEPS - 1}):
        verdict = jax_replay.verify_challenge(device, step, transition=transition)
        assert verdict.ok, (step, verdict.reason, verdict.message)


@pytest.mark.timeout(900)
def test_updates_inside_a_scan_replay_exactly_on_the_tpu(tmp_path: Path) -> None:
    """The loop's gradients and updates against the replay's one-update programs, compiled
    apart (docs/jax.md 3.2): on the TPU's own environment every bit must agree."""
    import provers.jax_replay as jax_replay
    from zkdv.jax.replay import load_transition

    # "auto": a scan's updates are committed on the host path (the device path refuses them).
    run = _train(tmp_path, "scan", "auto")
    transcript = verify_transcript(run)
    assert transcript.root["program"]["kind"] == "jax.export"
    assert jax_replay.exact_environment(transcript.root)
    transition = load_transition(run)
    for step in range(STEPS):
        verdict = jax_replay.verify_challenge(run, step, transition=transition)
        assert verdict.ok, (step, verdict.reason, verdict.message)
        assert all(e.exact for e in verdict.evidence), step


def _digest(arrays: list[Any]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_the_canonical_update_has_the_cpus_bits() -> None:
    """The same canonical programs on the TPU and on this machine's CPU backend."""
    import test_canonical as cases

    cpu = jax.devices("cpu")[0]
    tpu = next(d for d in jax.devices() if d.platform == TPU)
    for name in sorted(cases.TRANSFORMS):
        tx = cases.TRANSFORMS[name]()
        program = jax.jit(
            lambda zero, *args, tx=tx: zkdv.jax.canonical.canonical(cases.step_function(tx), zero)(
                *args
            )
        )
        results = {}
        for label, device in (("cpu", cpu), ("tpu", tpu)):
            params = jax.device_put(cases.make_params(), device)
            state = jax.device_put(tx.init(params), device)
            outputs = []
            for grads in cases.make_grads(cases.make_params()):
                args = jax.device_put((grads, state, params), device)
                updates, state, params = program(jax.device_put(cases.ZERO, device), *args)
                outputs += jax.tree.leaves((updates, state, params))
            results[label] = _digest(outputs)
        assert results["tpu"] == results["cpu"], name


@pytest.mark.timeout(1200)
def test_forgeries_are_caught_on_the_tpu(tmp_path: Path) -> None:
    """The attacks of test_forgery_jax, on runs trained and replayed on the TPU."""
    # The forgery suite's harness is shared with the Torch attacks: on a TPU machine,
    # `pip install --find-links /opt/wheels torch` (a CPU build; the JAX attacks need no
    # Django).
    pytest.importorskip("torch")
    from test_forgery_jax import ATTACKS, DRAWS

    from tests.agent.zkdv.torch.test_forgery_suite import _suite

    results = _suite().run_jax_suite(
        ATTACKS, trials=1, draws=DRAWS, steps=24, seed=0, work=tmp_path
    )
    for attack in ATTACKS:
        assert (results[attack].caught, results[attack].trials) == (DRAWS, DRAWS), attack
