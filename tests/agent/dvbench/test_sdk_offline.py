"""Offline mode: nothing touches the network; ``dvbench sync`` uploads later, once."""

from __future__ import annotations

import httpx
import pytest

import dvbench
from dvbench import Client
from dvbench._cli import main
from dvbench._manifest import Manifest

pytestmark = pytest.mark.django_db(transaction=True)


def no_network(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"offline mode sent {request.method} {request.url}")


def test_offline_keeps_everything_on_disk_then_sync_uploads_it(
    platform, fake_backend, monkeypatch, capsys
):
    monkeypatch.setenv("DVBENCH_MODE", "offline")
    with Client(platform.url, transport=httpx.MockTransport(no_network)) as client:
        assert client.offline
        experiment = client.experiment("acme/offline-run")  # never registered yet
        proof = experiment.proof(backend="jax")
        proof.start(rolling_window=4)
        proof.step()
        result = proof.finish()
        assert proof.finish() is result
    assert result.offline and not result.complete and not result.released
    directory = result.directory
    err = capsys.readouterr().err
    assert f"dvbench sync {directory}" in err
    assert (directory / "records.cborl").exists()
    manifest = Manifest.load(directory)
    assert manifest.data["finished"] and not manifest.data["synced"]
    assert manifest.data["spec"]["framework"] == "jax"  # registered by sync

    # Online again: `dvbench sync` (no DIR) finds the run in the cache and uploads it,
    # registering the experiment with the spec the transcript was bound to.
    monkeypatch.delenv("DVBENCH_MODE")
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    assert main(["sync", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "acme/offline-run" in out and "proof" in out
    synced = Manifest.load(directory)
    assert synced.data["synced"] and synced.data["proof"]
    assert all(
        entry["status"] in ("complete", "deduplicated", "empty") for entry in synced.files.values()
    )
    with Client() as client:
        experiment = client.experiment("acme/offline-run", create=False)
        assert experiment.spec_digest == synced.data["spec_digest"]
        assert client.get_proof(synced.data["proof"])["status"] == "valid"
        # Syncing again is idempotent: nothing sent, the same proof.
        again = client.sync(directory, progress=False)
    assert again.bytes_sent == 0 and again.proof_id == synced.data["proof"]
    assert main(["sync"]) == 0
    assert "nothing to sync" in capsys.readouterr().out


def test_offline_uses_the_cached_spec_of_a_registered_experiment(
    platform, fake_backend, monkeypatch
):
    declared = {**dvbench.default_spec("jax"), "model_description": "declared online"}
    with Client(platform.url, api_key=platform.key("alice")) as client:
        online = client.experiment("acme/cached", spec=declared)
    monkeypatch.setenv("DVBENCH_MODE", "offline")
    with Client(platform.url, transport=httpx.MockTransport(no_network)) as client:
        offline = client.experiment("acme/cached")
        assert offline.registered and offline.spec_digest == online.spec_digest
        proof = offline.proof(backend="jax")
    assert proof.bound == ("acme/cached", online.spec_digest)


def test_an_unfinished_run_is_not_synced_as_a_proof(platform, fake_backend, monkeypatch, capsys):
    monkeypatch.setenv("DVBENCH_MODE", "offline")
    with Client(platform.url, transport=httpx.MockTransport(no_network)) as client:
        proof = client.experiment("acme/crashed").proof(backend="jax")
        proof.start(rolling_window=4)
        proof.step()  # ... and the process dies: no finish()
    monkeypatch.delenv("DVBENCH_MODE")
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url)
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    assert main(["sync", "--no-progress", str(proof.directory)]) == 1
    assert "has not finished" in capsys.readouterr().err
    # `dvbench sync` of the whole cache reports it and goes on.
    assert main(["sync", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "skipping 1 run(s)" in err and "nothing to sync" in out


def test_a_proof_counts_tokens_in_the_unit_its_spec_declares(
    platform, fake_backend, monkeypatch
) -> None:
    # The spec says what max_tokens counts; the run's config follows it, whatever the
    # script passed, and the root record commits it.
    import zkdv

    monkeypatch.setenv("DVBENCH_MODE", "offline")
    spec = {**dvbench.default_spec("jax"), "token_unit": "tokens"}
    with Client(platform.url, transport=httpx.MockTransport(no_network)) as client:
        experiment = client.experiment("acme/lm-run", spec=spec)
        proof = experiment.proof(
            backend="jax",
            config=zkdv.ZKDVConfig(name="lm", token_unit="examples"),
        )
        assert proof.config.token_unit == "tokens" and proof.config.name == "lm"
        plain = client.experiment("acme/classifier-run").proof(backend="jax")
        assert plain.config.token_unit == "examples"
    assert experiment.spec_digest == dvbench.spec_digest("acme/lm-run", spec)
