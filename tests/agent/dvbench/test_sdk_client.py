"""Client against a live platform: configuration, experiments, and errors users branch on."""

from __future__ import annotations

import httpx
import pytest

import dvbench
from dvbench import Client

pytestmark = pytest.mark.django_db(transaction=True)


def test_it_reads_url_and_key_from_the_environment(platform, monkeypatch):
    monkeypatch.setenv("DVBENCH_BASE_URL", platform.url + "/api/v1/")
    monkeypatch.setenv("DVBENCH_API_KEY", platform.key("alice"))
    with Client() as client:
        assert client.base_url == platform.url
        me = client.me()
    assert me["username"] == "alice"
    assert [(o["slug"], o["role"]) for o in me["organizations"]] == [("acme", "trainer")]


def test_it_has_default_timeouts_and_closes(monkeypatch):
    monkeypatch.delenv("DVBENCH_TIMEOUT")
    client = Client("http://127.0.0.1:9")
    assert isinstance(client.timeout, httpx.Timeout)
    assert client.timeout.connect == 10.0 and client.timeout.read == 60.0
    client.close()
    client.close()  # closing twice is harmless
    with pytest.raises(dvbench.DVBenchError, match="closed"):
        client.me()


def test_it_registers_a_missing_experiment_with_the_default_spec(platform):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/new-run")
        assert not experiment.registered
        # Registration waits for proof(backend=...), which names the framework; an
        # explicit spec registers at once.
        spec = dvbench.default_spec("torch")
        other = client.experiment("acme/declared", spec=spec)
        assert other.registered and other.framework == "torch"
        assert len(other.spec_digest or "") == 64
        again = client.experiment("acme/declared")
        assert again.spec_digest == other.spec_digest
        assert {e.name for e in client.experiments()} == {"acme/declared"}


def test_a_wrong_key_is_an_authentication_error(platform):
    client = Client(platform.url, api_key="dvb_000000000000_wrong")
    with client, pytest.raises(dvbench.AuthenticationError) as caught:
        client.experiment("acme/anything")
    error = caught.value
    assert error.status_code == 401
    assert error.code == "invalid_api_key"
    assert error.request_id and len(error.request_id) >= 16
    assert "DVBENCH_API_KEY" in str(error) and "dvbench login" in str(error)
    assert isinstance(error, dvbench.APIError)


def test_no_key_says_how_to_log_in(platform):
    client = Client(platform.url)
    with client, pytest.raises(dvbench.AuthenticationError, match="dvbench login"):
        client.me()


def test_an_experiment_of_another_organisation_is_not_found(platform):
    with Client(platform.url, api_key=platform.key("alice")) as alice:
        alice.experiment("acme/secret", spec=dvbench.default_spec("jax"))
    with Client(platform.url, api_key=platform.key("mallory")) as mallory:
        with pytest.raises(dvbench.NotFoundError):
            mallory.experiment("acme/secret", create=False)
        # Trying to use it registers nothing: acme is out of mallory's sight.
        with pytest.raises(dvbench.NotFoundError) as caught:
            mallory.experiment("acme/secret").proof(backend="jax")
        assert "acme" in str(caught.value) and "member" in str(caught.value)
        assert caught.value.request_id


def test_an_auditor_may_not_register(platform):
    bob = Client(platform.url, api_key=platform.key("bob"))
    with bob, pytest.raises(dvbench.PermissionDeniedError) as caught:
        bob.create_experiment("acme/by-bob")
    assert caught.value.status_code == 403
    assert "trainer" in str(caught.value)


def test_an_invalid_spec_names_the_field(platform):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        spec = {**dvbench.default_spec("jax"), "dataset_commitment": "xyz"}
        with pytest.raises(dvbench.BadRequestError) as caught:
            client.create_experiment("acme/bad-spec", spec)
    assert caught.value.field == "spec.dataset_commitment"
    assert caught.value.status_code == 400


def test_a_framework_registers_at_once(platform):
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/torch-now", framework="torch")
        assert experiment.registered and experiment.framework == "torch"
        assert experiment.spec == {**experiment.spec, **dvbench.default_spec("torch")}


def test_an_unknown_organisation_says_so(platform):
    client = Client(platform.url, api_key=platform.key("alice"))
    with client, pytest.raises(dvbench.NotFoundError, match="no organisation 'nosuch'") as caught:
        client.experiment("nosuch/run").register(framework="jax")
    assert caught.value.field == "owner"
    with pytest.raises(ValueError, match="owner/name"):
        Client(platform.url).experiment("Not A Name")
