"""One workload, two frameworks, one token claim.

The same classifier and the same small language model, trained with zkdv.jax and with
zkdv.torch on the same batches, give the same ``tokens`` claim in the same unit: a
classifier counts examples (the default ``token_unit``), a sequence model that declares
``token_unit="tokens"`` counts its token ids. Before, the digits example claimed 195,000
"tokens" in JAX (the packed batch's words) and 3,000 in Torch (its labels).
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")
pytest.importorskip("flax")

import jax
import jax.numpy as jnp
import optax
import torch
from flax import linen as nn
from torch import nn as tnn

import zkdv
import zkdv.jax
import zkdv.torch
from attestations.certificates.claims import ClaimSet, Limits, evaluate
from attestations.certificates.run_facts import summarize
from zkdv.records import iter_records

pytestmark = pytest.mark.slow

STEPS = 3
EXAMPLES, FEATURES, CLASSES = 32, 16, 4
SEQUENCES, POSITIONS, VOCAB, WIDTH = 8, 17, 50, 16
NO_CHECKS = zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0))


def _classifier_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, EXAMPLES).astype(np.int32),
        )
        for _ in range(STEPS)
    ]


def _token_batches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, (SEQUENCES, POSITIONS)).astype(np.int32) for _ in range(STEPS)]


def _jax_run(
    path: Path, config: zkdv.ZKDVConfig, model: Any, sample: Any, loss: Any, batches: list[Any]
) -> Path:
    proof = zkdv.jax.ZKDV(path, config, replay_snapshot_interval=STEPS)
    proof.start(rolling_window=2, probe_ratio=0.5)
    state = zkdv.jax.contrib.TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), sample)["params"],
        tx=optax.adam(1e-2),
    )

    @proof.jit(donate_argnums=(0,))
    def step(state: Any, batch: tuple[jax.Array, ...]) -> Any:
        return state.apply_gradients(grads=jax.grad(loss)(state.params, state.apply_fn, *batch))

    for batch in batches:
        state = step(state, tuple(jnp.asarray(part) for part in batch))
    proof.close()
    return path


def _torch_run(
    path: Path,
    config: zkdv.ZKDVConfig,
    model: tnn.Module,
    loss: Callable[..., torch.Tensor],
    batches: list[Any],
) -> Path:
    torch.manual_seed(0)
    proof = zkdv.torch.ZKDV(path, config, replay_snapshot_interval=STEPS)
    proof.start(rolling_window=2, probe_ratio=0.5)
    model, optimizer = proof.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))

    @proof.attest
    def attested(model: tnn.Module, optimizer: Any, batch: Any) -> None:
        proof.backward(loss(lambda *x: proof.forward(model, *x), *batch))
        optimizer.step()
        optimizer.zero_grad()

    for batch in batches:
        tensors = tuple(
            torch.from_numpy(part).long() if part.dtype == np.int32 else torch.from_numpy(part)
            for part in batch
        )
        with proof.transaction(batch=tensors):
            proof.backward(loss(model, *tensors))
            optimizer.step()
            optimizer.zero_grad()
    proof.close()
    return path


class JaxClassifier(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(CLASSES)(jnp.tanh(nn.Dense(32)(x)))


class JaxLM(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return nn.Dense(VOCAB)(jnp.tanh(nn.Embed(VOCAB, WIDTH)(tokens)))


def _jax_classifier_loss(params: Any, apply: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _jax_lm_loss(params: Any, apply: Any, tokens: jax.Array) -> jax.Array:
    logits = apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _torch_classifier_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return tnn.functional.cross_entropy(model(x), y)


def _torch_lm_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return tnn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _claims(path: Path, limits: Limits) -> ClaimSet:
    return evaluate(summarize(iter_records(path)), limits)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("units-classifier")
    batches = _classifier_batches()
    jax_path = _jax_run(
        root / "jax",
        NO_CHECKS,
        JaxClassifier(),
        jnp.zeros((1, FEATURES)),
        _jax_classifier_loss,
        batches,
    )
    model = tnn.Sequential(tnn.Linear(FEATURES, 32), tnn.Tanh(), tnn.Linear(32, CLASSES))
    torch_path = _torch_run(root / "torch", NO_CHECKS, model, _torch_classifier_loss, batches)
    return jax_path, torch_path


@pytest.fixture(scope="module")
def language_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("units-lm")
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0), token_unit="tokens"
    )
    batches = [(tokens,) for tokens in _token_batches()]
    jax_path = _jax_run(
        root / "jax",
        config,
        JaxLM(),
        jnp.zeros((1, POSITIONS - 1), jnp.int32),
        _jax_lm_loss,
        batches,
    )
    model = tnn.Sequential(tnn.Embedding(VOCAB, WIDTH), tnn.Tanh(), tnn.Linear(WIDTH, VOCAB))
    torch_path = _torch_run(root / "torch", config, model, _torch_lm_loss, batches)
    return jax_path, torch_path


def test_a_classifier_claims_its_examples_in_both_frameworks(
    classifiers: tuple[Path, Path],
) -> None:
    claims = [_claims(path, Limits()) for path in classifiers]
    for claim in claims:
        assert claim.value("tokens") == STEPS * EXAMPLES
        assert claim.claim("tokens").unit == "example"  # type: ignore[union-attr]
        assert claim.details["tokens"]["token_unit"] == "examples"
    # The FLOPs estimate is as much the same: each counts the step's program (XLA's cost
    # analysis, Torch's FLOP counter), both dominated by the same matrix products.
    jax_flops, torch_flops = (claim.value("flops") for claim in claims)
    assert jax_flops == torch_flops, (jax_flops, torch_flops)


def test_a_language_model_claims_its_tokens_in_both_frameworks(
    language_models: tuple[Path, Path],
) -> None:
    limits = Limits(max_tokens=Decimal(10_000), token_unit="tokens")
    for path in language_models:
        claims = _claims(path, limits)
        assert claims.value("tokens") == STEPS * SEQUENCES * POSITIONS
        assert claims.claim("tokens").unit == "token"  # type: ignore[union-attr]
        assert claims.violations == []


def test_a_run_counted_in_another_unit_than_declared_breaks_max_tokens(
    classifiers: tuple[Path, Path], language_models: tuple[Path, Path]
) -> None:
    # A lab that declared a maximum in tokens cannot pass it by counting examples.
    for path in classifiers:
        claims = _claims(path, Limits(max_tokens=Decimal(10**9), token_unit="tokens"))
        (violation,) = claims.violations
        assert (violation.limit, violation.declared, violation.actual) == (
            "token_unit",
            "tokens",
            "examples",
        )
        assert "max_tokens is declared in tokens, and the run counts examples" in violation.message
    # Without a declared maximum the unit is only stated.
    assert _claims(language_models[0], Limits()).violations == []


def test_token_unit_tokens_needs_token_ids(tmp_path: Path) -> None:
    config = zkdv.ZKDVConfig(
        sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0), token_unit="tokens"
    )
    with pytest.raises(ValueError, match=r"first integer array of rank >= 2 .* float32\[32, 16\]"):
        _jax_run(
            tmp_path / "jax",
            config,
            JaxClassifier(),
            jnp.zeros((1, FEATURES)),
            _jax_classifier_loss,
            _classifier_batches(),
        )
    with pytest.raises(ValueError, match="ZKDVConfig token_unit='words' must be one of"):
        zkdv.ZKDVConfig(token_unit="words")
