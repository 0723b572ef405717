"""``dvbench download-report`` against a live platform, then ``verify-report`` offline.

Also: every single-bit change of a downloaded bundle is refused by the verifier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attestations.accounts.models import ApiKey
from attestations.certificates.models import Certificate
from dvbench.__main__ import main
from dvbench.attest import TrustRoot, verify_bundle
from tests.attestations.base import World
from tests.attestations.certificate_helpers import certify


@pytest.fixture
def sdk_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the developer's credentials; failures are not retried for long."""
    for name in ("DVBENCH_BASE_URL", "DVBENCH_API_KEY", "DVBENCH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("DVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DVBENCH_MAX_RETRIES", "0")


def _as(monkeypatch: pytest.MonkeyPatch, live_server: Any, world: World, actor: str) -> None:
    _, key = ApiKey.issue(world.users[actor], "cli test")
    monkeypatch.setenv("DVBENCH_BASE_URL", live_server.url)
    monkeypatch.setenv("DVBENCH_API_KEY", key)


def test_download_report_then_verify_report_offline(
    transactional_db: None,
    live_server: Any,
    world: World,
    sdk_environment: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    certificate = certify(world.proof)
    _as(monkeypatch, live_server, world, "carol")  # a regulator, outside acme
    bundle = tmp_path / "report.json"
    trust_root = tmp_path / "trust-root.json"
    assert (
        main(
            [
                "download-report",
                str(certificate.proof_id),
                "-o",
                str(bundle),
                "--trust-root-out",
                str(trust_root),
                "--sigstore-out",
                str(tmp_path / "certificate.sigstore.json"),
                "--trusted-root-out",
                str(tmp_path / "trusted_root.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"saved the report bundle of proof {certificate.proof_id}" in out
    assert "in Sigstore's format to" in out

    # Offline from here on: the platform is no longer asked anything.
    monkeypatch.setenv("DVBENCH_BASE_URL", "http://127.0.0.1:9")
    assert main(["verify-report", str(bundle), "--trust-root", str(trust_root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verified: certificate PASSED")
    assert f"log entry {certificate.log_index} of dvbench.localhost/log" in out

    # The Sigstore bundle with the Sigstore trusted root: one trust root file, the
    # timestamp authority's token checked too.
    sigstore = ["verify-report", str(tmp_path / "certificate.sigstore.json")]
    assert main([*sigstore, "--trust-root", str(tmp_path / "trusted_root.json")]) == 0
    assert capsys.readouterr().out.startswith("verified: certificate PASSED")

    # One changed character of the claims, re-encoded as valid JSON, is refused too.
    document = json.loads(bundle.read_text())
    document["inclusion_proof"]["log_index"] += 1
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(document))
    assert main(["verify-report", str(tampered), "--trust-root", str(trust_root)]) == 1
    assert "rejected (" in capsys.readouterr().err


def test_download_report_of_a_proof_outside_your_organisation_fails(
    transactional_db: None,
    live_server: Any,
    world: World,
    sdk_environment: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    certificate = certify(world.proof)
    _as(monkeypatch, live_server, world, "mallory")
    output = tmp_path / "stolen.json"
    assert main(["download-report", str(certificate.proof_id), "-o", str(output)]) == 1
    assert "404" in capsys.readouterr().err
    assert not output.exists()


def test_every_flipped_bit_of_a_downloaded_bundle_fails_verification(
    world: World, api: Any
) -> None:
    certificate: Certificate = certify(world.proof)
    data = api("bob").get(f"/api/v1/proofs/{certificate.proof_id}/bundle/").content
    root = TrustRoot.from_json(api(None).get("/api/v1/trust-root/").content)
    assert verify_bundle(data, root).ok
    accepted = []
    for position in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            if verify_bundle(bytes(flipped), root).ok:
                accepted.append((position, bit))
    assert accepted == [], [data[p - 20 : p + 20] for p, _ in accepted[:5]]


def test_the_sigstore_bundle_verifies_with_standard_tools(
    world: World, api: Any, tmp_path: Path
) -> None:
    """The platform's own output, checked by Sigstore's verifiers (no DVBench code)."""
    import base64
    import copy
    import shutil
    import subprocess

    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    certificate = certify(world.proof)
    bundle = api("bob").get(f"/api/v1/proofs/{certificate.proof_id}/sigstore-bundle/").json()
    response = api(None).get("/api/v1/trusted-root/")  # public, like trust-root/
    assert response.status_code == 200
    document = response.json()
    assert document["mediaType"] == "application/vnd.dev.sigstore.trustedroot+json;version=0.1"
    assert len(document["tlogs"]) == 1 and len(document["timestampAuthorities"]) == 1
    entry = bundle["verificationMaterial"]["tlogEntries"][0]
    assert entry["kindVersion"] == {"kind": "dsse", "version": "0.0.1"}
    assert "inclusionPromise" in entry
    assert bundle["verificationMaterial"]["timestampVerificationData"]["rfc3161Timestamps"]

    # securesystemslib, with the key as SSlibKey.from_crypto derives it (no key id by hand).
    pem = json.loads(api(None).get("/api/v1/trust-root/").content)["keys"][-1]["public_key"]
    verifier = SSlibKey.from_crypto(load_pem_public_key(pem.encode()))
    assert verifier.keyid == certificate.keyid
    assert Envelope.from_dict(copy.deepcopy(bundle["dsseEnvelope"])).verify([verifier], 1)

    # Ours, with the Sigstore trusted root as the one trust root file.
    assert verify_bundle(bundle, TrustRoot.from_json(json.dumps(document))).ok

    # @sigstore/verify (npm's verifier) with its default policy.
    node = shutil.which("node")
    verify_js = Path(__file__).resolve().parents[2] / "sigstore_js" / "verify.js"
    if node is None or not (verify_js.parent / "node_modules" / "@sigstore" / "verify").is_dir():
        pytest.skip(
            "Sigstore's JavaScript verifier is not installed (node, npm ci in tests/sigstore_js)"
        )
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    (tmp_path / "r.json").write_text(json.dumps(document))
    command = [node, str(verify_js), "b.json", "r.json"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "verified"), done
    envelope = bundle["dsseEnvelope"]
    payload = bytearray(base64.b64decode(envelope["payload"]))
    payload[-3] ^= 1
    envelope["payload"] = base64.b64encode(bytes(payload)).decode()
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and done.stdout.startswith("TLOG_BODY_ERROR"), done
