"""The certificate names every step whose state passed only within the probes' tolerance.

Two JAX runs are trained in a subprocess on XLA's SSE4.2 kernels (another kernel family
than this process's): one whose update is declared with ``Transaction.update(...)`` and
``proof.attest`` alone (it commits no gradient: the probes' tolerance path), one that
also declares its gradient and Optax transformation (``grads=``, ``tx=``: the exact
path). Each window is replayed here by the platform's prover, its verdicts stored as the
challenges' evidence, and the ``detection_guarantee`` claim built from them: the first
run's steps that were not reproduced bit for bit are listed under ``within_tolerance``,
in no other judgement, and the run's ``update`` says its state is judged within
tolerance and why; the second run's steps are all ``within_bounds`` (state exact).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from django.template.loader import render_to_string

import provers
from attestations.certificates.subjects import guarantee_claim
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.reports.render import report_context
from provers.replay import Transcript, windows
from tests.attestations.base import World
from tests.processes import run_jax
from zkdv.verify import verify_transcript

pytest.importorskip("jax")
pytest.importorskip("optax")

pytestmark = pytest.mark.slow

STEPS = 6
TOLERANCE = {"abs": 1e-6, "rel": 1e-5}

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax, zkdv

    def train(path, declared):
        proof = zkdv.jax.ZKDV(
            path,
            zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
            replay_snapshot_interval=3,
        )
        proof.start(rolling_window=2, probe_ratio=0.5)
        tx = optax.sgd(0.05, momentum=0.9)

        def gradient(params, batch):
            def loss(p):
                return jnp.mean((jnp.tanh(batch[:, :6] @ p["w"]) @ p["v"] - batch[:, 6]) ** 2)
            return jax.grad(loss)(params)

        if not declared:
            @proof.attest
            def attested(params, opt_state, batch, parameter_index, state_index):
                updates, new_state = tx.update(gradient(params, batch), opt_state, params)
                return (zkdv.jax.index(updates, parameter_index),
                        zkdv.jax.index(new_state, state_index))

        @proof.jit
        def step(params, opt_state, batch):
            transaction = zkdv.jax.Transaction(batch=batch, params=params, opt_state=opt_state)
            grads = gradient(params, batch)
            updates, new_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            extra = {"grads": grads, "tx": tx} if declared else {}
            transaction.update(deltas=updates, params=new_params, opt_state=new_state, **extra)
            return new_params, new_state

        key_w, key_v = jax.random.split(jax.random.key(0))
        params = {"w": jax.random.normal(key_w, (6, 8)) * 0.3,
                  "v": jax.random.normal(key_v, (8,)) * 0.3}
        opt_state = tx.init(params)
        rng = np.random.default_rng(1)
        for _ in range(int(sys.argv[2])):
            batch = jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)
            params, opt_state = step(params, opt_state, batch)
        proof.close()

    train(sys.argv[1] + "/tolerance", False)
    train(sys.argv[1] + "/declared", True)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("judged")
    script = where / "train.py"
    script.write_text(SCRIPT)
    run_jax(
        [script, where, STEPS], folder=where, name="train", xla_flags="--xla_cpu_max_isa=SSE4_2"
    )
    return where


def _guarantee(world: World, path: Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The claim built from this process's replay of every window of ``path``."""
    transcript = Transcript.load(path)
    proof = world.proof
    proof.steps = STEPS
    proof.report = verify_transcript(path).to_dict()  # as the ingest stores it
    proof.save(update_fields=["steps", "report"])
    verdicts = []
    for first, last in windows(transcript):
        verdict = provers.verify_challenge(path, first, through=last).to_dict()
        assert verdict["ok"], verdict["message"]
        verdicts.append(verdict)
        Challenge.objects.create(
            proof=proof,
            step=first,
            through=last,
            origin=ChallengeOrigin.RANDOM,
            status=ChallengeStatus.PASSED,
            evidence=verdict,
        )
    claim = guarantee_claim(proof, TOLERANCE)
    return claim.value, verdicts


@pytest.mark.timeout(600)  # the training subprocess has 420 s
def test_steps_judged_by_the_probes_tolerance_are_named_as_such(world: World, runs: Path) -> None:
    value, verdicts = _guarantee(world, runs / "tolerance")
    judgement = value["judgement"]
    assert isinstance(judgement, dict)
    states = {e["step"]: e["state"] for v in verdicts for e in v["evidence"]}  # type: ignore[index, union-attr]
    assert sorted(states) == list(range(STEPS))
    tolerated = sorted(step for step, state in states.items() if state == "tolerance")
    # Other kernels round this update otherwise: no step of it can claim exactness.
    assert tolerated, states
    assert judgement["within_tolerance"] == tolerated
    assert not set(tolerated) & (set(judgement["exact"]) | set(judgement["within_bounds"]))
    assert value["replayed_steps"]["within_tolerance"] == tolerated  # type: ignore[index]
    assert value["comparison"] == "tolerance"
    (worker,) = value["environments"]["replay"]  # type: ignore[index]
    assert worker["judgement"] == "within_bounds" and worker["within_tolerance"] == tolerated
    update = value["update"]
    assert update == {
        "commits_gradient": False,
        "state": "within_tolerance",
        "reason": "the run commits no gradient: each step's whole transition is replayed "
        "and judged by the probes' tolerance on other hardware",
    }
    # The auditors' report says so in words, with the steps.
    context = report_context(world.proof)
    context["certificate"] = {**(context.get("certificate") or {}), "guarantee": value}
    text = " ".join(render_to_string("attestations/report_body.html", context).split())
    named = ", ".join(str(step) for step in tolerated)
    assert (
        f"{len(tolerated)} only within the probes' tolerance, not the exact guarantee</strong>"
        in text
    ), text
    assert f"the state not reproduced bit for bit): steps {named}" in text
    assert "Update judged" in text and "the run commits no gradient" in text


@pytest.mark.timeout(600)
def test_a_declared_update_is_judged_within_bounds_with_its_state_exact(
    world: World, runs: Path
) -> None:
    value, verdicts = _guarantee(world, runs / "declared")
    assert value["judgement"] == {
        "exact": [],
        "within_bounds": list(range(STEPS)),
        "within_tolerance": [],
    }
    assert {e["state"] for v in verdicts for e in v["evidence"]} == {"exact"}  # type: ignore[union-attr]
    assert value["update"] == {"commits_gradient": True, "state": "exact", "reason": None}
