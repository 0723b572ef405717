"""Claims of a real zkdv.jax run: FLOPs from XLA's cost analysis, the optimizer from its
state, one program digest, and the regime the trainer declared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("flax")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import zkdv
from attestations.certificates.claims import Limits, evaluate
from attestations.certificates.run_facts import summarize
from dvbench.attest import Evidence
from zkdv.jax.contrib import TrainState
from zkdv.records import iter_records

pytestmark = pytest.mark.slow
STEPS = 3


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))[:, 0]


def _step(state: Any, batch: jax.Array) -> Any:
    def loss(params: Any) -> jax.Array:
        return jnp.mean((state.apply_fn({"params": params}, batch[:, :6]) - batch[:, 6]) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("jax-claims") / "proof"
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=2,
    )
    proof.bind_experiment("acme/tiny", "ab" * 32)
    proof.declare_regime("fine-tuning")
    proof.start(rolling_window=2, probe_ratio=0.5)
    model = MLP()
    state = TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), jnp.ones((4, 6)))["params"],
        tx=optax.adamw(1e-3),
    )
    step = proof.jit(_step, donate_argnums=(0,))
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        state = step(state, jnp.asarray(rng.standard_normal((4, 7)), jnp.float32))
    proof.close()
    return path


def test_claims_of_a_jax_run(run: Path) -> None:
    records = [record.data for record in iter_records(run)]
    root, steps = records[0], [r for r in records if r["t"] == "step"]
    per_step = steps[0]["flops"]
    assert per_step and per_step > 0  # XLA's cost analysis of the compiled program

    claims = evaluate(
        summarize(iter_records(run)),
        Limits(optimizer="optax.adamw(1e-3)", allowed_regimes=("fine-tuning", "pretraining")),
    )

    assert claims.value("steps") == STEPS
    # One device, one compiled program: the same count every step, summed.
    assert claims.value("flops") == round(STEPS * per_step)
    assert claims.details["flops"]["source"] == "step.flops"
    assert claims.details["flops"]["replicas"] == 1
    optimizer = claims.value("optimizer")
    assert (optimizer["family"], optimizer["matches_declared"]) == ("adam", True)
    assert claims.value("program_digest") == root["program"]["digest"].hex()
    assert claims.value("regime")["declared_by_trainer"] == "fine-tuning"
    assert claims.claim("regime").evidence == Evidence.REPORTED  # type: ignore[union-attr]
    assert claims.violations == []


def test_a_declared_regime_the_spec_does_not_allow(run: Path) -> None:
    claims = evaluate(summarize(iter_records(run)), Limits(allowed_regimes=("pretraining",)))
    (violation,) = claims.violations
    assert (violation.limit, violation.actual) == ("allowed_regimes", "fine-tuning")
