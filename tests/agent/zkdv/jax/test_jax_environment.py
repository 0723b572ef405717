"""The root record names the platform a JAX run trained on, and its replay environment key.

The platform routes a run's replays by its platform kind and judges them exactly where a
worker's replay environment key (``zkdv.environments.replay_environment``) equals the
run's: these tests check what the root records on this CPU, and what the key is made of.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jaxlib
import optax
import pytest
from jax_helpers import apply_fn, batches, init_params, train_step

from provers import jax_replay
from zkdv.environments import (
    differences,
    kind_of_backend,
    platform_kind,
    replay_environment,
)
from zkdv.jax.contrib import TrainState
from zkdv.verify import verify_transcript


def _trained_root(make_proof: Any, tmp_path: Path) -> dict[str, Any]:
    proof = make_proof(interval=2)
    state = TrainState.create(
        proof=proof, apply_fn=apply_fn, params=init_params(), tx=optax.adamw(0.05)
    )
    step = proof.jit(train_step, donate_argnums=(0,))
    for batch in batches(2):
        state = step(state, batch)
    proof.close()
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    return report.root


def test_the_root_names_the_platform_the_versions_and_the_flags(
    make_proof: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("the values below are a CPU run's")
    # Flags that change a TPU's bits are recorded wherever the run trains.
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_all_gather=true")
    root = _trained_root(make_proof, tmp_path)
    env = root["env"]
    assert env["platform_kind"] == "cpu" == jax.devices()[0].platform
    assert env["device_kind"] == jax.devices()[0].device_kind
    assert env["jax"] == jax.__version__
    assert env["jaxlib"] == jaxlib.__version__
    # The CPU's generation is its instruction set, capped by --xla_cpu_max_isa.
    assert env["cpu_isa"] and env["cpu_isa"] != "unknown"
    assert env["xla_flags"] == ""
    assert env["matmul_precision"] == "default"
    # No libtpu here; the key is recorded, empty, as is the runtime's flag variable.
    assert "libtpu" in env and env["libtpu"] is None
    assert env["libtpu_init_args"] == "--xla_tpu_enable_async_all_gather=true"
    assert "platform_version" in env
    key = replay_environment(root)
    assert key["platform_kind"] == "cpu" and key["prover"] == "whitebox-jax"
    # On a CPU the accelerator runtime is not part of the key: it does not run.
    assert "libtpu_init_args" not in key and "libtpu" not in key
    # This process is the run's environment: no difference, so replays are exact.
    assert jax_replay.environment_differences(root) == []
    assert jax_replay.exact_environment(root)
    worker = {"prover": "whitebox-jax", "env": jax_replay.environment()}
    assert replay_environment(worker) == key


def _tpu_root(**env: Any) -> dict[str, Any]:
    values = {
        "jax_platform": "tpu",
        "platform_kind": "tpu",
        "device_kind": "TPU v5 lite",
        "devices": ["TPU v5 lite"],
        "jaxlib": "0.10.2",
        "threads": 8,
        "cpu_isa": "AVX512",
        "cpu_model": "AMD EPYC",
        "cpu_features": ["avx2"],
        "xla_flags": "",
        "x64": False,
        "matmul_precision": "default",
        "platform_version": "PJRT C API\nTFRT TPU v5 lite\nBuilt on ...",
        "libtpu": "0.0.20",
        "libtpu_init_args": "",
    }
    values.update(env)
    return {"prover": "whitebox-jax", "env": values}


def test_the_key_of_an_accelerator_run_holds_its_runtime() -> None:
    root = _tpu_root()
    key = replay_environment(root)
    assert key["platform_kind"] == "tpu"
    assert key["libtpu"] == "0.0.20" and key["libtpu_init_args"] == ""
    assert differences(root, _tpu_root()) == []
    assert differences(root, _tpu_root(libtpu="0.0.21")) == ["libtpu"]
    assert differences(root, _tpu_root(libtpu_init_args="--xla_tpu_x=1")) == ["libtpu_init_args"]
    assert differences(root, _tpu_root(devices=["TPU v6e"])) == ["devices"]
    # A CPU worker differs in its kind, its backend and the runtime it lacks.
    cpu = {"prover": "whitebox-jax", "env": {**root["env"], "jax_platform": "cpu"}}
    cpu["env"].pop("platform_kind")
    assert {"platform_kind", "jax_platform"} <= set(differences(root, cpu))
    # So this CPU process never claims a TPU run exact.
    assert not jax_replay.exact_environment({**root, "schema": {"grad": []}})


def test_the_kind_of_a_backend_and_of_older_roots() -> None:
    assert [kind_of_backend(b) for b in ("cpu", "tpu", "cuda", "rocm", "gpu", "cuda:1")] == [
        "cpu",
        "tpu",
        "gpu",
        "gpu",
        "gpu",
        "gpu",
    ]
    assert kind_of_backend("METAL") == "metal"
    # Roots from before the kind was recorded: read from the backend they name.
    assert platform_kind({"env": {"jax_platform": "tpu"}}) == "tpu"
    assert platform_kind({"env": {"device": "cuda:0"}}) == "gpu"
    assert platform_kind({"env": {"platform": "linux"}}) == "cpu"
    # A recorded entry the root lacks is a difference: never exact by assumption.
    root = _tpu_root()
    del root["env"]["libtpu"]
    assert differences(root, _tpu_root()) == ["libtpu"]
