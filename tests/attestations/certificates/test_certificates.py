"""Certificate issuance: what is signed, with which key, and that it is issued exactly once."""

from __future__ import annotations

import base64
import copy
import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from django.db import connection
from securesystemslib.dsse import Envelope as SslibEnvelope

# securesystemslib documents this name but its __init__ does not re-export it for mypy.
from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

from attestations.audit.models import AuditEvent
from attestations.certificates import issuance, keys, translog
from attestations.certificates.models import (
    Certificate,
    LogCheckpoint,
    LogEntry,
    PlatformKey,
    TrustRootVersion,
)
from attestations.certificates.tasks import issue_certificate
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.core.db import AppendOnlyError
from attestations.proofs.models import Proof, ProofStatus
from dvbench.attest import (
    PAYLOAD_TYPE_INTOTO,
    Evidence,
    KeyConfigurationError,
    KeyNotValidError,
    Result,
    SigningKey,
    TrainingCertificate,
    TrustRoot,
    sign_certificate,
    spki_key_id,
    verify_bundle,
    verify_certificate,
)
from tests.attestations.base import World
from tests.attestations.certificate_helpers import certify, finalize, new_proof


def _trust_root() -> TrustRoot:
    return keys.current_trust_root().trust_root()


def test_a_valid_proof_gets_a_passed_certificate_that_our_library_verifies(world: World) -> None:
    certificate = certify(world.proof)

    signed = verify_certificate(certificate.envelope, _trust_root())
    assert signed.result is Result.PASSED
    assert certificate.result == "PASSED"
    report = world.proof.report
    assert report is not None
    assert signed.transcript_digest == report["digest"] == certificate.transcript_digest
    assert signed.final_parameter_root == report["final"]["p"]
    assert signed.policy_digest == world.experiment.current_spec.digest  # type: ignore[union-attr]
    assert signed.experiment == "acme/run-1"
    assert signed.verifier_id == "https://dvbench.localhost"
    assert signed.log.index == certificate.log_index == 0
    assert signed.log.origin == "dvbench.localhost/log"
    assert signed.trust_root_version == 1
    assert signed.trust_root_digest == TrustRootVersion.objects.get(version=1).digest
    claims = {claim.name: claim for claim in signed.claims}
    assert claims["steps"].value == 4
    assert claims["steps"].evidence is Evidence.COMMITTED
    assert claims["final_parameter_root"].value == report["final"]["p"]
    assert claims["limit_violations"].value == []
    assert certificate.flops == int(claims["flops"].value)
    # Never challenged: the documented "no replay" evidence.
    assert signed.replay.challenge_seed == issuance.NO_REPLAY_SEED
    assert signed.replay.challenged_steps == ()
    assert dict(signed.replay.tolerance) == report["root"]["config"]["tolerance"]


def test_the_envelope_verifies_with_securesystemslib(world: World) -> None:
    certificate = certify(world.proof)
    key = PlatformKey.objects.get(keyid=certificate.keyid)
    public = SSlibKey.from_crypto(load_pem_public_key(key.public_key.encode()), keyid=key.keyid)
    theirs = SslibEnvelope.from_dict(copy.deepcopy(dict(certificate.envelope)))
    accepted = theirs.verify([public], 1)
    assert set(accepted) == {key.keyid}
    assert theirs.payload_type == PAYLOAD_TYPE_INTOTO
    assert json.loads(theirs.payload)["predicate"]["result"] == "PASSED"


def test_settings_name_the_verifier_and_the_log(world: World, settings: Any) -> None:
    settings.DVBENCH = {
        **settings.DVBENCH,
        "VERIFIER_ID": "https://verifier.example.org",
        "LOG_ORIGIN": "",
    }
    signed = verify_certificate(certify(world.proof).envelope, _trust_root())
    assert signed.verifier_id == "https://verifier.example.org"
    assert signed.log.origin == "verifier.example.org/log"
    assert LogCheckpoint.objects.get().note.startswith("verifier.example.org/log\n1\n")


def test_a_run_over_its_declared_limits_gets_a_failed_certificate_naming_them(
    world: World,
) -> None:
    # The spec declares Adam; the synthetic run trains with SGD.
    certificate = certify(world.proof, within_limits=False)
    signed = verify_certificate(certificate.envelope, _trust_root())
    assert signed.result is Result.FAILED and certificate.result == "FAILED"
    (violation,) = next(c for c in signed.claims if c.name == "limit_violations").value
    assert violation["limit"] == "optimizer" and "adam" in violation["message"]
    event = AuditEvent.objects.get(action="certificate.issued")
    assert event.detail["violations"][0]["limit"] == "optimizer"


def test_a_rejected_proof_gets_a_failed_certificate(world: World) -> None:
    certificate = certify(world.proof, status=ProofStatus.REJECTED)
    assert certificate.result == "FAILED"
    assert verify_certificate(certificate.envelope, _trust_root()).result is Result.FAILED


def test_replay_evidence_names_the_revealed_seed_and_every_challenged_step(world: World) -> None:
    seed = "5e" * 32
    finalize(world.proof)
    Proof.objects.filter(pk=world.proof.pk).update(
        challenge_seed=seed, challenge_seed_revealed=datetime.now(UTC)
    )
    for step, through, origin in (
        (0, None, ChallengeOrigin.GENESIS),
        (7, 9, ChallengeOrigin.WINDOW),
    ):
        Challenge.objects.create(
            proof=world.proof,
            step=step,
            through=through,
            origin=origin,
            status=ChallengeStatus.PASSED,
        )
    world.proof.refresh_from_db()
    signed = verify_certificate(certify(world.proof).envelope, _trust_root())
    assert signed.replay.challenge_seed == seed
    assert signed.replay.challenged_steps == (0, 7, 8, 9)


def test_issuing_twice_issues_once(world: World) -> None:
    finalize(world.proof)
    first = issue_certificate.delay(world.proof.pk).get()
    second = issue_certificate.delay(world.proof.pk).get()
    assert first == second == f"certificate {Certificate.objects.get().pk}"
    assert LogEntry.objects.count() == 1
    assert LogCheckpoint.objects.count() == 1
    assert AuditEvent.objects.filter(action="certificate.issued").count() == 1


@pytest.mark.parametrize("status", [ProofStatus.PENDING, ProofStatus.VERIFYING, ProofStatus.ERROR])
def test_a_proof_without_a_final_verdict_gets_no_certificate(world: World, status: str) -> None:
    finalize(world.proof, status=status)
    assert issue_certificate.delay(world.proof.pk).get() is None
    assert not Certificate.objects.exists() and not LogEntry.objects.exists()


def test_a_transcript_without_a_close_record_gets_no_certificate(world: World) -> None:
    finalize(world.proof, status=ProofStatus.REJECTED)
    Proof.objects.filter(pk=world.proof.pk).update(
        report={"ok": False, "final": None}, transcript_digest=""
    )
    assert issue_certificate.delay(world.proof.pk).get() is None
    assert not LogEntry.objects.exists()


def test_an_unknown_proof_gets_no_certificate(world: World) -> None:
    assert issue_certificate.delay(10**9).get() is None


def test_certificates_are_append_only(world: World) -> None:
    certificate = certify(world.proof)
    entry = certificate.log_entry
    with pytest.raises(AppendOnlyError):
        Certificate.objects.filter(pk=certificate.pk).update(result="FAILED")
    with pytest.raises(AppendOnlyError):
        certificate.save()
    with pytest.raises(AppendOnlyError):
        LogEntry.objects.all().delete()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        LogCheckpoint.objects.update(root_hash="00" * 32)
    with pytest.raises(AppendOnlyError):
        TrustRootVersion.objects.all().delete()
    assert Certificate.objects.get().result == "PASSED"


@pytest.mark.skipif(
    os.environ.get("DATABASE_URL") is None, reason="the SQL trigger exists on PostgreSQL only"
)
def test_postgresql_refuses_sql_updates_and_deletes_of_the_log(world: World) -> None:
    from django.db import DatabaseError, transaction

    certify(world.proof)
    for statement in (
        "UPDATE attestations_logentry SET leaf_hash = %s",
        "DELETE FROM attestations_logentry WHERE leaf_hash <> %s",
        "UPDATE attestations_certificate SET result = 'FAILED' WHERE keyid <> %s",
        "DELETE FROM attestations_logcheckpoint WHERE root_hash <> %s",
    ):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(statement, ["00" * 32])
    assert LogEntry.objects.count() == 1


# --- keys -----------------------------------------------------------------------------


def test_the_generated_key_lives_in_the_data_dir_with_mode_0600_and_never_in_the_db(
    world: World, settings: Any
) -> None:
    certificate = certify(world.proof)
    folder = Path(settings.DVBENCH["DATA_DIR"]) / "keys"
    path = folder / "signing-key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    key = SigningKey.from_file(path)
    assert key.keyid == certificate.keyid
    private = key.private_pem().decode()
    body = "".join(private.splitlines()[1:-1])
    with connection.cursor() as cursor:
        for table in ("attestations_platformkey", "attestations_trustrootversion"):
            cursor.execute(f"SELECT * FROM {table}")
            dump = repr(cursor.fetchall())
            assert "PRIVATE KEY" not in dump and body[:40] not in dump


def test_a_configured_key_signs(world: World, settings: Any, tmp_path: Path) -> None:
    key = SigningKey.generate()
    path = tmp_path / "secret.pem"
    path.write_bytes(key.private_pem())
    settings.DVBENCH = {**settings.DVBENCH, "SIGNING_KEY_FILE": str(path)}
    assert certify(world.proof).keyid == key.keyid
    assert not (tmp_path / "keys" / "signing-key.pem").exists()


def test_a_key_from_the_environment_setting_signs(world: World, settings: Any) -> None:
    key = SigningKey.generate()
    settings.DVBENCH = {**settings.DVBENCH, "SIGNING_KEY": key.private_pem().decode()}
    assert certify(world.proof).keyid == key.keyid


def test_a_configured_key_outside_the_trust_root_refuses_to_sign(
    world: World, settings: Any
) -> None:
    keys.current_trust_root()  # the generated key becomes version 1
    stranger = SigningKey.generate()
    settings.DVBENCH = {**settings.DVBENCH, "SIGNING_KEY": stranger.private_pem().decode()}
    finalize(world.proof)
    with pytest.raises(KeyConfigurationError, match="rotate_signing_key"):
        issue_certificate.delay(world.proof.pk).get()
    assert not Certificate.objects.exists() and not LogEntry.objects.exists()


def test_rotation_starts_a_new_key_and_old_certificates_still_verify(world: World) -> None:
    old = certify(world.proof)
    old_bundle = translog.bundle_for(old)
    rotation = keys.rotate_key()
    assert rotation.old_keyid == old.keyid and rotation.new_keyid != old.keyid
    assert rotation.trust_root.version == 2
    retired = PlatformKey.objects.get(keyid=old.keyid)
    assert retired.not_after == rotation.at
    assert PlatformKey.objects.get(keyid=rotation.new_keyid).not_before == rotation.at
    assert AuditEvent.objects.filter(action="signing_key.rotated").count() == 1

    new = certify(new_proof(world.experiment, seed=1))
    assert new.keyid == rotation.new_keyid and new.trust_root_version == 2
    latest = _trust_root()
    assert latest.version == 2
    # Both certificates verify against the latest trust root, each at its own time.
    later = rotation.at + timedelta(minutes=1)
    assert verify_bundle(old_bundle, latest, now=later).ok
    assert verify_bundle(translog.bundle_for(old), latest, now=later).ok
    assert verify_bundle(translog.bundle_for(new), latest, now=later).ok
    # An auditor who pinned version 1 still verifies the old certificate's bundle: its
    # checkpoint was signed at issuance, by the key version 1 lists.
    first = TrustRootVersion.objects.get(version=1).trust_root()
    assert verify_bundle(translog.bundle_for(old), first, now=later).ok
    assert not verify_bundle(translog.bundle_for(new), first, now=later).ok
    report = translog.verify_log()
    assert report.ok and report.trust_roots == 2, report.problems


def test_a_key_registered_under_its_old_spki_id_keeps_signing(world: World, api: Any) -> None:
    """A platform whose key, trust root and certificates predate securesystemslib key ids."""
    from dvbench.attest.legacy import spki_key_ids

    with spki_key_ids():
        old = certify(world.proof)
    assert old.keyid == spki_key_id(
        load_pem_public_key(PlatformKey.objects.get().public_key.encode())
    )  # type: ignore[arg-type]
    assert _trust_root().keys[0].keyid == old.keyid
    # Now: the same key signs under its securesystemslib id; nothing was re-registered.
    new = certify(new_proof(world.experiment, seed=1))
    assert new.keyid != old.keyid and PlatformKey.objects.count() == 1
    assert new.keyid == SSlibKey.from_crypto(_trust_root().keys[0].public_key).keyid
    root = _trust_root()
    for certificate in (old, new):
        assert verify_bundle(translog.bundle_for(certificate), root).ok
        assert verify_bundle(translog.sigstore_bundle_for(certificate), root).ok
    trusted = TrustRoot.from_json(api(None).get("/api/v1/trusted-root/").content)
    assert verify_bundle(translog.sigstore_bundle_for(new), trusted).ok
    assert translog.verify_log().problems == []
    rotation = keys.rotate_key()
    assert rotation.old_keyid == old.keyid
    assert translog.verify_log().problems == []


def test_rotation_closes_the_keys_window_in_the_sigstore_trusted_root(
    world: World, api: Any
) -> None:
    certify(world.proof)
    before = api(None).get("/api/v1/trusted-root/").json()
    assert [set(t["publicKey"]["validFor"]) for t in before["tlogs"]] == [{"start"}]
    rotation = keys.rotate_key()
    after = api(None).get("/api/v1/trusted-root/").json()
    windows = [t["publicKey"]["validFor"] for t in after["tlogs"]]
    at = rotation.at.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert windows == [{"start": windows[0]["start"], "end": at}, {"start": at}]
    # The timestamp authority does not rotate with the signing key.
    assert after["timestampAuthorities"] == before["timestampAuthorities"]


def test_a_bundle_is_the_same_at_every_download(world: World) -> None:
    first = certify(world.proof)
    before = translog.bundle_for(first)
    certify(new_proof(world.experiment, seed=1))
    assert translog.bundle_for(first) == before
    assert before["inclusion_proof"]["tree_size"] == first.log_index + 1


def test_a_certificate_signed_by_a_key_outside_its_window_fails(world: World) -> None:
    old = certify(world.proof)
    retired = SigningKey.from_file(keys.keys_dir() / "signing-key.pem")
    keys.rotate_key()
    root = _trust_root()
    signed = verify_certificate(old.envelope, root)
    # The retired key signs a certificate dated after its window closed.
    forged = TrainingCertificate(
        **{
            **signed.__dict__,
            "issued_at": root.key(retired.keyid).not_after + timedelta(seconds=5),  # type: ignore[operator]
        }
    )
    with pytest.raises(KeyNotValidError, match="outside the key's validity window"):
        verify_certificate(sign_certificate(forged, retired), root)
    # And one dated before the key existed.
    early = TrainingCertificate(
        **{**signed.__dict__, "issued_at": root.key(retired.keyid).not_before - timedelta(days=1)}
    )
    with pytest.raises(KeyNotValidError):
        verify_certificate(sign_certificate(early, retired), root)


def test_the_retired_private_key_is_deleted_on_rotation(world: World) -> None:
    certify(world.proof)
    path = keys.keys_dir() / "signing-key.pem"
    before = SigningKey.from_file(path).keyid
    rotation = keys.rotate_key()
    after = SigningKey.from_file(path)
    assert after.keyid == rotation.new_keyid != before
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # The timestamp authority (tsa.pem) is not a signing key and does not rotate with it.
    assert sorted(p.name for p in keys.keys_dir().iterdir()) == [
        "signing-key.pem",
        "tsa.pem",
    ]
    assert before not in path.read_text()


def test_rotating_to_the_configured_key_twice_is_refused(world: World, settings: Any) -> None:
    keys.current_trust_root()
    incoming = SigningKey.generate()
    settings.DVBENCH = {**settings.DVBENCH, "SIGNING_KEY": incoming.private_pem().decode()}
    assert keys.rotate_key().new_keyid == incoming.keyid
    with pytest.raises(KeyConfigurationError, match="already in the trust root"):
        keys.rotate_key()
    assert TrustRootVersion.objects.count() == 2


def test_statement_and_claims_helpers_read_the_signed_payload(world: World) -> None:
    certificate = certify(world.proof)
    payload = json.loads(base64.b64decode(certificate.envelope["payload"]))
    assert certificate.statement() == payload
    names = [claim["name"] for claim in certificate.claims()]
    assert names[:3] == ["steps", "tokens", "flops"]
    # The run's claims end with limit_violations; the platform's statements follow.
    assert names[-4:] == [
        "limit_violations",
        "lineage",
        "regulatory_thresholds",
        "detection_guarantee",
    ]
    world.proof.refresh_from_db()
    assert world.proof.certificate == certificate  # what the proof page's panel reads


def test_the_rotate_signing_key_command(world: World, tmp_path: Path, settings: Any) -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    first = keys.current_trust_root().trust_root().keys[0].keyid
    out = StringIO()
    call_command("rotate_signing_key", stdout=out)
    assert f"key {first} retired" in out.getvalue() and "trust root version 2" in out.getvalue()

    imported = SigningKey.generate()
    path = tmp_path / "incoming.pem"
    path.write_bytes(imported.private_pem())
    call_command("rotate_signing_key", "--key-file", str(path), stdout=out)
    assert SigningKey.from_file(keys.keys_dir() / "signing-key.pem").keyid == imported.keyid
    assert PlatformKey.objects.get(keyid=imported.keyid).source == "imported"

    settings.DVBENCH = {
        **settings.DVBENCH,
        "SIGNING_KEY": SigningKey.generate().private_pem().decode(),
    }
    with pytest.raises(CommandError, match="put the new key there"):
        call_command("rotate_signing_key", "--key-file", str(path))
    with pytest.raises(CommandError, match="cannot read signing key file"):
        call_command("rotate_signing_key", "--key-file", str(tmp_path / "missing.pem"))
    assert TrustRootVersion.objects.count() == 3


def test_issue_certificates_issues_what_a_failed_task_left_missing(
    world: World, settings: Any
) -> None:
    from io import StringIO

    from django.core.management import call_command

    keys.current_trust_root()
    original = settings.DVBENCH
    settings.DVBENCH = {**original, "SIGNING_KEY": SigningKey.generate().private_pem().decode()}
    finalize(world.proof)
    with pytest.raises(KeyConfigurationError):
        issue_certificate.delay(world.proof.pk).get()
    settings.DVBENCH = original  # the operator fixes the key configuration
    out = StringIO()
    call_command("issue_certificates", stdout=out)
    certificate = Certificate.objects.get(proof=world.proof)
    assert f"proof {world.proof.pk}: certificate {certificate.pk} (PASSED), log entry 0" in (
        out.getvalue()
    )
    call_command("issue_certificates", stdout=out)
    assert "no certificate is missing" in out.getvalue()
    assert Certificate.objects.count() == 1
