"""experiment.proof(): the driver with DVBench behaviour, its background uploads and finish().

A small stand-in driver (numpy only) writes batch files as it "trains" and a real
transcript when it closes, so these tests run in a second; the JAX and Torch drivers
themselves are exercised end to end in test_sdk_tutorial.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import dvbench
from dvbench import Client
from dvbench._manifest import MANIFEST, Manifest
from dvbench._proof import proof_class
from tests.synthetic import write_synthetic_transcript

pytestmark = pytest.mark.django_db(transaction=True)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def uploads(client: Client, name: str) -> list[dict]:
    return list(client.paginate("uploads/", {"experiment": name}))


def test_proof_is_the_backend_driver_with_dvbench_added():
    zkdv_jax = pytest.importorskip("zkdv.jax")
    cls = proof_class(zkdv_jax.ZKDV)
    assert issubclass(cls, zkdv_jax.ZKDV) and issubclass(cls, dvbench.DVBenchProof)
    assert proof_class(zkdv_jax.ZKDV) is cls  # created once per backend
    for method in ("start", "jit", "attest", "join", "close", "finish"):
        assert callable(getattr(cls, method))


def test_it_uploads_in_the_background_and_finish_is_idempotent(platform, fake_backend):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/fake")
        proof = experiment.proof(backend="jax", max_in_flight=3)
        assert experiment.registered and experiment.framework == "jax"
        assert proof.experiment is experiment
        # The transcript is bound to the experiment and its spec digest.
        assert proof.bound == ("acme/fake", experiment.spec_digest)
        assert proof.max_in_flight == 3  # driver options reach the driver
        assert proof.path == proof.directory
        assert str(proof.directory).startswith(os.environ["DVBENCH_CACHE_DIR"])
        assert (proof.directory / MANIFEST).exists()
        proof.start(rolling_window=4)
        proof.step()
        proof.step()
        # While "training", the batch files go up from the uploader thread.
        wait_for(lambda: sum(u["kind"] == "batch" for u in uploads(client, "acme/fake")) == 2)
        result = proof.finish()
        assert result.complete and result.released
        assert result.proof_id is not None and result.proof_url.endswith(
            f"/proofs/{result.proof_id}/"
        )
        assert not proof.directory.exists()
        assert proof.closed == 1
        # Calling again changes nothing and sends nothing.
        assert proof.finish() is result
        assert proof.closed == 1
        filed = client.get_proof(result.proof_id)
        assert filed["status"] == "valid" and filed["experiment"] == "acme/fake"
        done = uploads(client, "acme/fake")
        assert {u["status"] for u in done} == {"complete"}
        # Nothing went up twice: the background uploads were not repeated by finish().
        assert len({(u["sha256"], u["kind"]) for u in done}) == len(done)
        assert {u["kind"] for u in done} == {"artifact", "batch", "snapshot", "transcript"}


def test_finish_after_a_failed_upload_resumes(platform, proxy, fake_backend, monkeypatch):
    monkeypatch.setenv("DVBENCH_MAX_RETRIES", "1")
    down = {"on": True}
    faulty = proxy(lambda method, path, n: "503" if down["on"] and "complete" in path else "pass")
    with Client(faulty.url, api_key=platform.key("alice")) as client:
        proof = client.experiment("acme/flaky").proof(backend="jax")
        proof.start(rolling_window=4)
        proof.step()
        with pytest.raises(dvbench.ServerError) as caught:
            proof.finish()
        assert any("finish() again" in note for note in caught.value.__notes__)
        assert (proof.directory / "records.cborl").exists()  # nothing is lost
        down["on"] = False
        result = proof.finish()
    assert result.complete and result.proof_id is not None
    assert not proof.directory.exists()


def test_a_with_block_finishes_and_an_error_keeps_the_proof(platform, fake_backend, tmp_path):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/blocks")
        with experiment.proof(backend="jax", path=tmp_path / "kept") as proof:
            proof.start(rolling_window=4)
            proof.step()
        manifest = Manifest.load(tmp_path / "kept")  # a given path is never removed
        assert manifest.data["synced"] and manifest.data["proof"]
        with pytest.raises(RuntimeError), experiment.proof(backend="jax") as failing:
            failing.start(rolling_window=4)
            raise RuntimeError("training crashed")
        assert failing.closed == 1
        assert failing.directory.exists()


def test_a_proof_directory_is_never_reused(platform, fake_backend, tmp_path):
    write_synthetic_transcript(tmp_path / "old")
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/reuse")
        with pytest.raises(dvbench.DVBenchError, match="already holds a transcript"):
            experiment.proof(backend="jax", path=tmp_path / "old")


def test_the_declared_framework_must_match(platform, fake_backend):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/torchy", spec=dvbench.default_spec("torch"))
        with pytest.raises(dvbench.DVBenchError, match="declares framework 'torch'"):
            experiment.proof(backend="jax")
        with pytest.raises(ValueError, match="backend"):
            experiment.proof(backend="tensorflow")


def test_an_auditor_is_stopped_before_training_not_at_upload(platform, fake_backend):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        client.experiment("acme/audited", spec=dvbench.default_spec("jax"))
    with Client(platform.url, api_key=platform.key("bob")) as bob:
        experiment = bob.experiment("acme/audited")  # an auditor may read it
        with pytest.raises(dvbench.PermissionDeniedError, match="trainer role"):
            experiment.proof(backend="jax")


def test_a_slow_network_never_stalls_a_step(platform, proxy, fake_backend):
    # Every part upload is held at the proxy until the test releases it. Training steps
    # must complete while a part is stuck on the network: a causal check, not a timing.
    held = proxy(lambda method, path, n: "hold" if method == "PUT" else "pass")
    with Client(held.url, api_key=platform.key("alice")) as client:
        proof = client.experiment("acme/slow").proof(backend="jax")
        proof.start(rolling_window=4)
        proof.step()
        assert held.holding.wait(120), "the background uploader never sent a part"
        steps = threading.Thread(target=lambda: [proof.step() for _ in range(5)])
        steps.start()
        steps.join(120)  # a liveness bound only: a step waiting on the network never returns
        assert not steps.is_alive(), "a training step waited for the network"
        assert held.puts("hold") and not held.released.is_set()
        held.released.set()
        result = proof.finish()
    assert result.complete
