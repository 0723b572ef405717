"""Certificates for auditors' tools: the final model, sha256 subjects, the Sigstore bundle,
the log's verifier key, regulatory thresholds and the detection guarantee.

The end-to-end part runs ``manage.py demo --exit`` (the example trains, saves its weights
as safetensors signed with model_signing, the platform certifies them) and checks the
result with ``model_signing`` and ``dvbench verify-report`` as an auditor would.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rest_framework.test import APIClient

from attestations.certificates import issuance, keys
from attestations.proofs.models import ProofStatus
from dvbench.attest import TrustRoot, note_verifier_key, verify_bundle
from dvbench.weights import write_safetensors
from tests.attestations.base import World, error_of, upload_blob
from tests.attestations.certificate_helpers import certify, finalize, new_proof
from tests.conftest import EmbeddedDemo

Api = Callable[[str | None], APIClient]
REPO_ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


def _statement(certificate: Any) -> dict[str, Any]:
    return json.loads(base64.b64decode(certificate.envelope["payload"]))


def _claims(statement: dict[str, Any]) -> dict[str, Any]:
    return {claim["name"]: claim for claim in statement["predicate"]["claims"]}


# --- subjects, thresholds, guarantee -------------------------------------------------------


def test_the_certificate_binds_the_transcript_file_by_sha256(world: World) -> None:
    certificate = certify(world.proof)
    statement = _statement(certificate)
    subjects = {subject["name"]: subject["digest"] for subject in statement["subject"]}
    world.proof.refresh_from_db()
    assert subjects["records.cborl"] == {"sha256": world.proof.transcript.sha256}
    # Every subject whose bytes the auditor holds carries a sha256 beside its custom digest.
    assert subjects["zkdv/transcript"] == {
        "zkdv-transcript": world.proof.transcript_digest,
        "sha256": world.proof.transcript.sha256,
    }
    # No model uploaded: the auditor holds no bytes of the final parameters.
    assert set(subjects["zkdv/final-parameters"]) == {"zkdv-state-root"}


def test_thresholds_take_the_compute_claims_evidence_and_settings(
    world: World, settings: Any
) -> None:
    settings.DVBENCH = {
        **settings.DVBENCH,
        "REGULATORY_THRESHOLDS": [
            {"name": "tiny", "flops": 10, "description": "below any real run"},
            {"name": "huge", "flops": 10**25, "description": ""},
        ],
    }
    statement = _statement(certify(world.proof))
    claims = _claims(statement)
    thresholds = claims["regulatory_thresholds"]
    assert thresholds["evidence"] == claims["flops"]["evidence"]
    assert thresholds["unit"] == "FLOP"
    rows = {row["name"]: row for row in thresholds["value"]}
    assert rows["tiny"]["stays_below"] is False and rows["huge"]["stays_below"] is True
    assert rows["huge"]["threshold"] == 10**25


def test_the_default_thresholds_are_the_eu_ai_acts_and_the_us_frontier_laws(
    world: World,
) -> None:
    rows = _claims(_statement(certify(world.proof)))["regulatory_thresholds"]["value"]
    assert [(row["name"], row["threshold"]) for row in rows] == [
        ("eu-ai-act-gpai", 10**23),
        ("eu-ai-act-systemic-risk", 10**25),
        ("us-frontier-model", 10**26),
    ]
    assert "SB 53" in rows[2]["description"] and "RAISE Act" in rows[2]["description"]


def test_a_bad_threshold_setting_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from config.settings import regulatory_thresholds

    for raw, words in (
        ("{", "not JSON"),
        ('[{"name": "A B", "flops": 1}]', "lowercase slug"),
        ('[{"name": "a", "flops": -1}]', "positive"),
        ('[{"name": "a", "flops": 1}, {"name": "a", "flops": 2}]', "twice"),
        ('[{"name": "a", "flops": 1, "counts": "family"}]', '"run" or "lineage"'),
        ('[{"name": "a", "flops": 1, "scope": "run"}]', "name, flops, description, counts"),
    ):
        monkeypatch.setenv("DVBENCH_REGULATORY_THRESHOLDS", raw)
        with pytest.raises(ImproperlyConfigured, match=words):
            regulatory_thresholds()
    monkeypatch.setenv("DVBENCH_REGULATORY_THRESHOLDS", '[{"name": "x", "flops": 1e24}]')
    assert regulatory_thresholds() == [
        {"name": "x", "flops": 10**24, "description": "", "counts": "run"}
    ]
    monkeypatch.setenv(
        "DVBENCH_REGULATORY_THRESHOLDS", '[{"name": "x", "flops": 1e26, "counts": "lineage"}]'
    )
    assert regulatory_thresholds()[0]["counts"] == "lineage"


def test_the_regulator_filters_certificates_by_threshold(world: World, api: Api) -> None:
    certificate = certify(world.proof)  # a few hundred FLOPs: below both thresholds
    client = api("carol")
    below = client.get("/api/v1/certificates/?below_threshold=eu-ai-act-systemic-risk")
    assert [item["id"] for item in below.json()["results"]] == [certificate.pk]
    assert below.json()["results"][0]["regulatory_thresholds"][1]["stays_below"] is True
    above = client.get("/api/v1/certificates/?above_threshold=eu-ai-act-gpai")
    assert above.json()["results"] == []
    unknown = client.get("/api/v1/certificates/?above_threshold=eu-ai-act")
    assert unknown.status_code == 400
    error = error_of(unknown)
    assert error["field"] == "above_threshold" and "eu-ai-act-gpai" in error["detail"]["allowed"]


def test_an_unchallenged_run_states_no_guarantee(world: World) -> None:
    guarantee = _claims(_statement(certify(world.proof)))["detection_guarantee"]
    assert guarantee["value"]["challenges"] == 0
    assert guarantee["value"]["detection_probability"] == 0.0
    assert guarantee["value"]["tolerance"] == {"abs": 1e-06, "rel": 0.001}


# --- the Sigstore bundle and the verifier key ------------------------------------------------


def test_the_sigstore_bundle_verifies_and_only_readers_get_it(world: World, api: Api) -> None:
    certificate = certify(world.proof)
    url = f"/api/v1/proofs/{world.proof.pk}/sigstore-bundle/"
    response = api("carol").get(url)
    assert response.status_code == 200
    assert response["Content-Disposition"].endswith('.sigstore.json"')
    root = TrustRoot.from_json(APIClient().get("/api/v1/trust-root/").content)
    result = verify_bundle(response.content, root)
    assert result.ok, result.summary()
    assert result.certificate is not None and result.certificate.log.index == certificate.log_index
    assert api("mallory").get(url).status_code == 404
    assert api(None).get(url).status_code == 401


def test_the_verifier_key_is_published_in_the_trust_root_and_the_api(world: World) -> None:
    certify(world.proof)
    anonymous = APIClient()
    published = anonymous.get("/api/v1/log/verifier-key/").json()
    root = TrustRoot.from_json(anonymous.get("/api/v1/trust-root/").content)
    key = root.keys[-1]
    expected = note_verifier_key(keys.log_origin(), key.public_key)
    assert published["verifier_key"] == expected == root.note_verifier_key(key.keyid)
    assert published["origin"] == root.log_origin == keys.log_origin()
    # Every checkpoint's signature line starts with the verifier key's hash.
    note = anonymous.get("/api/v1/log/checkpoint/").json()["note"]
    line = note.split("\n\n")[1]
    assert base64.b64decode(line.split()[-1])[:4].hex() == expected.split("+")[1]


# --- the final model on the platform ---------------------------------------------------------


def _synthetic_final_parameters(steps: int = 4, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """The parameters ``tests.synthetic.write_synthetic_transcript`` ends its run with."""
    from tests.synthetic import LinearSGD, _leaves

    model = LinearSGD(6)
    params, state = model.init(seed)
    rng = np.random.default_rng(seed + 1)
    for batch in [rng.integers(0, 1000, size=(8, 7), dtype=np.uint32) for _ in range(steps)]:
        _, params, state = model.update(params, state, batch)
    return _leaves(params)


def _attach(client: APIClient, proof: int, name: str, data: bytes) -> Any:
    done = upload_blob(client, data)
    assert done.status_code == 200, done.content
    body = {"files": [{"name": name, "kind": "artifact", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}]}  # fmt: skip
    return client.post(f"/api/v1/proofs/{proof}/artifacts/", body, format="json")


def test_uploaded_weights_must_be_the_final_parameters(
    world: World, api: Api, tmp_path: Path
) -> None:
    proof = new_proof(world.experiment)
    type(proof).objects.filter(pk=proof.pk).update(status=ProofStatus.CHALLENGED)
    leaves = _synthetic_final_parameters()
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    write_safetensors(good, leaves)
    write_safetensors(bad, [(path, array + np.float32(1e-3)) for path, array in leaves])
    client = api("alice")
    refused = _attach(client, proof.pk, "model/model.safetensors", bad.read_bytes())
    assert refused.status_code == 422, refused.content
    error = error_of(refused)
    assert error["code"] == "model_mismatch" and "final parameter root" in error["message"]
    accepted = _attach(client, proof.pk, "model/model.safetensors", good.read_bytes())
    assert accepted.status_code == 201, accepted.content
    finalize(proof)
    statement = _statement(issuance.issue_certificate(proof.pk))
    subjects = {subject["name"]: subject["digest"] for subject in statement["subject"]}
    assert subjects["model.safetensors"] == {
        "sha256": hashlib.sha256(good.read_bytes()).hexdigest()
    }
    model = _claims(statement)["final_model"]["value"]
    assert model["matches_final_parameter_root"] is True and model["model_signing"] is None


def test_a_model_outside_the_model_folder_is_refused(world: World, api: Api) -> None:
    proof = new_proof(world.experiment)
    type(proof).objects.filter(pk=proof.pk).update(status=ProofStatus.CHALLENGED)
    refused = _attach(api("alice"), proof.pk, "weights/model.safetensors", b"x" * 64)
    assert refused.status_code == 400 and error_of(refused)["code"] == "invalid_name"


# --- end to end: the demo's certificate and model, checked with the standard tools ----------


@pytest.fixture(scope="module")
def demo(embedded_demo: EmbeddedDemo) -> Path:
    """The report folder of the session's demo (tests/conftest.py)."""
    assert "Verification succeeded" in "\n".join(embedded_demo.printed)
    return embedded_demo.report


def _run(folder: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, check=False)


@pytest.mark.slow
def test_model_signing_verifies_the_demo_model_and_not_a_flipped_byte(demo: Path) -> None:
    verify = [str(BIN / "model_signing"), "verify", "key", "model.safetensors"]
    verify += ["--signature", "model.sig", "--public_key", "model-signing.pub"]
    done = _run(demo / "model", *verify)
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done
    dvbench = [sys.executable, "-m", "dvbench", "verify-report"]
    for bundle in ("bundle.json", "certificate.sigstore.json"):
        checked = _run(
            demo, *dvbench, bundle, "--trust-root", "trust-root.json", "--model", "model"
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    flipped = demo / "flipped"
    shutil.copytree(demo / "model", flipped)
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (flipped / "model.safetensors").write_bytes(bytes(data))
    done = _run(flipped, *verify)
    assert done.returncode == 1 and "Verification failed" in done.stderr, done
    checked = _run(demo, *dvbench, "certificate.sigstore.json", "--trust-root", "trust-root.json", "--model", "flipped")  # fmt: skip
    assert checked.returncode == 1 and "subject_mismatch" in checked.stderr, checked


@pytest.mark.slow
def test_both_bundles_carry_the_same_certificate_that_standard_tools_check(demo: Path) -> None:
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]
    from sigstore_models.bundle.v1 import Bundle

    report = json.loads((demo / "bundle.json").read_text())
    sigstore = json.loads((demo / "certificate.sigstore.json").read_text())
    assert sigstore["dsseEnvelope"] == report["envelope"]
    Bundle.from_json((demo / "certificate.sigstore.json").read_text())
    root = TrustRoot.from_json((demo / "trust-root.json").read_bytes())
    key = root.keys[-1]
    envelope = Envelope.from_dict(dict(sigstore["dsseEnvelope"]))
    # The key as SSlibKey.from_crypto derives it: its key id is the certificate's.
    assert key.keyid in envelope.verify([SSlibKey.from_crypto(key.public_key)], 1)
    statement = json.loads(base64.b64decode(sigstore["dsseEnvelope"]["payload"]))
    subjects = {subject["name"]: subject["digest"] for subject in statement["subject"]}
    records = (demo / "proof" / "records.cborl").read_bytes()
    assert subjects["records.cborl"]["sha256"] == hashlib.sha256(records).hexdigest()
    weights = (demo / "model" / "model.safetensors").read_bytes()
    assert subjects["model.safetensors"]["sha256"] == hashlib.sha256(weights).hexdigest()
    # Beside the custom digests, the sha256 of the bytes the auditor holds.
    assert subjects["zkdv/transcript"]["sha256"] == hashlib.sha256(records).hexdigest()
    assert subjects["zkdv/final-parameters"]["sha256"] == hashlib.sha256(weights).hexdigest()
    claims = _claims(statement)
    guarantee = claims["detection_guarantee"]["value"]
    assert guarantee["challenges"] > 0 and guarantee["comparison"] == "exact"
    m, f = guarantee["challenges"], guarantee["forged_fraction"]
    assert guarantee["detection_probability"] == pytest.approx(1 - (1 - f) ** m)
    assert claims["final_model"]["value"]["model_signing"]["verified"] is True


@pytest.mark.slow
def test_sigstore_js_verifies_the_demo_certificate(demo: Path) -> None:
    """@sigstore/verify, default policy, on the demo's certificate and trusted root."""
    node = shutil.which("node")
    verify_js = REPO_ROOT / "tests" / "sigstore_js" / "verify.js"
    if node is None or not (verify_js.parent / "node_modules" / "@sigstore" / "verify").is_dir():
        pytest.skip(
            "Sigstore's JavaScript verifier is not installed (node, npm ci in tests/sigstore_js)"
        )
    done = _run(demo, node, str(verify_js), "certificate.sigstore.json", "trusted_root.json")
    assert (done.returncode, done.stdout.strip()) == (0, "verified"), done
