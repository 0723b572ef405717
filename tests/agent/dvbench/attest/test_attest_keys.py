"""Signing keys (SPKI key ids, 0600 files, file/environment/generated sources) and the
trust root with validity windows."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dvbench.attest import (
    DEFAULT_KEY_FILENAME,
    ENV_SIGNING_KEY,
    KeyConfigurationError,
    KeyNotValidError,
    MalformedInputError,
    SigningKey,
    TrustRoot,
    UnknownKeyError,
    key_id,
    key_ids,
    load_signing_key,
    spki_key_id,
)

REPO = Path(__file__).resolve().parents[4]
START = datetime(2026, 1, 1, tzinfo=UTC)
ROTATION = datetime(2026, 7, 1, tzinfo=UTC)
# RFC 8410 section 4: an Ed25519 SubjectPublicKeyInfo is this 12-byte DER prefix
# followed by the 32-byte raw key.
ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


def test_key_id_is_securesystemslibs() -> None:
    """One key id everywhere: what SSlibKey.from_crypto computes (TUF's default key id)."""
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    key = SigningKey.generate()
    raw = key.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    document = '{"keytype":"ed25519","keyval":{"public":"' + raw.hex() + '"},"scheme":"ed25519"}'
    assert key.keyid == key_id(key.public_key) == hashlib.sha256(document.encode()).hexdigest()
    assert key.keyid == SSlibKey.from_crypto(key.public_key).keyid
    assert len(key.keyid) == 64
    assert repr(key) == f"SigningKey(keyid={key.keyid!r})"


def test_the_older_spki_key_id_still_names_the_key() -> None:
    """Trust roots and certificates issued before carry the SHA-256 of the SPKI DER."""
    key = SigningKey.generate()
    der = key.public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    raw = key.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert der == ED25519_SPKI_PREFIX + raw
    legacy = hashlib.sha256(der).hexdigest()
    assert spki_key_id(key.public_key) == legacy != key.keyid
    assert key_ids(key.public_key) == (key.keyid, legacy)
    # A trust root listing the key by its old id reads, and both ids find the key.
    root = TrustRoot.initial(key.public_key, not_before=datetime(2026, 1, 1, tzinfo=UTC))
    document = root.to_dict()
    document["keys"][0]["keyid"] = legacy
    old = TrustRoot.from_dict(document)
    assert old.keys[0].keyid == legacy
    assert old.key(key.keyid) is old.key(legacy)
    with pytest.raises(UnknownKeyError):
        old.key("ab" * 32)


def test_generated_key_files_are_0600_in_a_0700_directory(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "keys"
    key = SigningKey.generate_file(folder)
    path = folder / DEFAULT_KEY_FILENAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert SigningKey.from_file(path).keyid == key.keyid


def test_generated_key_files_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        SigningKey.generate_file(tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / DEFAULT_KEY_FILENAME).stat().st_mode) == 0o600


def test_it_never_overwrites_a_key(tmp_path: Path) -> None:
    SigningKey.generate_file(tmp_path)
    before = (tmp_path / DEFAULT_KEY_FILENAME).read_bytes()
    with pytest.raises(KeyConfigurationError, match="refusing to overwrite"):
        SigningKey.generate_file(tmp_path)
    assert (tmp_path / DEFAULT_KEY_FILENAME).read_bytes() == before


def test_load_prefers_path_then_environment_then_data_dir(tmp_path: Path) -> None:
    on_disk = SigningKey.generate_file(tmp_path / "secret")
    in_env = SigningKey.generate()
    env = {ENV_SIGNING_KEY: in_env.private_pem().decode()}
    data_dir = tmp_path / "data"

    chosen = load_signing_key(
        path=tmp_path / "secret" / DEFAULT_KEY_FILENAME, environ=env, data_dir=data_dir
    )
    assert chosen.keyid == on_disk.keyid
    assert load_signing_key(environ=env, data_dir=data_dir).keyid == in_env.keyid
    assert not data_dir.exists()

    generated = load_signing_key(environ={}, data_dir=data_dir)
    assert stat.S_IMODE((data_dir / DEFAULT_KEY_FILENAME).stat().st_mode) == 0o600
    # The default key is generated once and then kept.
    assert load_signing_key(environ={}, data_dir=data_dir).keyid == generated.keyid


def test_load_explains_what_is_missing_or_wrong(tmp_path: Path) -> None:
    with pytest.raises(KeyConfigurationError, match=f"set {ENV_SIGNING_KEY} to PEM text"):
        load_signing_key(environ={})
    with pytest.raises(KeyConfigurationError, match=f"{ENV_SIGNING_KEY}: not a PEM private key"):
        load_signing_key(environ={ENV_SIGNING_KEY: "not a key"})
    with pytest.raises(KeyConfigurationError, match="cannot read signing key file"):
        load_signing_key(path=tmp_path / "absent.pem")
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(KeyConfigurationError, match="must be Ed25519"):
        SigningKey.from_pem(pem)


def test_no_private_key_is_committed() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    marker = "-----BEGIN " + "PRIVATE KEY-----"
    found = subprocess.run(
        ["git", "grep", "-l", "-e", marker, "-e", marker.replace("BEGIN ", "BEGIN OPENSSH ")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert found.returncode == 1, f"private keys committed: {found.stdout}"


def test_trust_root_round_trips_canonically(key_2026a: SigningKey, key_2026b: SigningKey) -> None:
    root = TrustRoot.initial(key_2026a.public_key, not_before=START).rotate(
        key_2026b.public_key, at=ROTATION
    )
    document = root.to_dict()
    assert document["schema"] == "https://dvbench.dev/trust-root/v1"
    assert document["version"] == 2
    assert [entry["keyid"] for entry in document["keys"]] == [key_2026a.keyid, key_2026b.keyid]
    assert document["keys"][0]["not_after"] == "2026-07-01T00:00:00Z"
    assert document["keys"][1]["not_after"] is None
    again = TrustRoot.from_json(json.dumps(document, indent=2))
    assert again == root
    assert again.digest() == root.digest() == hashlib.sha256(root.to_json()).hexdigest()


def test_validity_windows_are_half_open(
    trust_root_v2: TrustRoot, key_2026a: SigningKey, key_2026b: SigningKey
) -> None:
    old, new = trust_root_v2.key(key_2026a.keyid), trust_root_v2.key(key_2026b.keyid)
    second = timedelta(seconds=1)
    assert not old.valid_at(START - second)
    assert old.valid_at(START)
    assert old.valid_at(ROTATION - second)
    assert not old.valid_at(ROTATION)
    assert new.valid_at(ROTATION)
    assert new.valid_at(datetime(2099, 1, 1, tzinfo=UTC))
    with pytest.raises(
        KeyNotValidError,
        match=r"2026-07-01T00:00:00Z, outside .* \[2026-01-01T00:00:00Z, 2026-07-01T00:00:00Z\)",
    ):
        old.check_valid_at(ROTATION)


def test_unknown_keys_are_named(trust_root_v1: TrustRoot) -> None:
    with pytest.raises(UnknownKeyError, match=r"key 0+ is not in the trust root \(version 1\)"):
        trust_root_v1.key("0" * 64)


def test_rotation_is_checked(
    trust_root_v1: TrustRoot, key_2026a: SigningKey, key_2026b: SigningKey
) -> None:
    with pytest.raises(ValueError, match="already in the trust root"):
        trust_root_v1.rotate(key_2026a.public_key, at=ROTATION)
    with pytest.raises(ValueError, match="must follow"):
        trust_root_v1.rotate(key_2026b.public_key, at=START)


def _entry(root: TrustRoot, **changes: object) -> dict[str, object]:
    document = root.to_dict()
    document["keys"][0].update(changes)
    return document


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"keyid": "ab" * 32}, "is neither the key's id"),
        ({"keyid": "AB" * 32}, "lowercase hex"),
        ({"algorithm": "ecdsa"}, "algorithm must be 'ed25519'"),
        (
            {"public_key": "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"},
            "not a PEM public key",
        ),
        ({"not_before": "2026-01-01 00:00:00"}, "RFC 3339 UTC time"),
        ({"not_before": "2026-02-30T00:00:00Z"}, "not a calendar time"),
        ({"not_after": "2025-01-01T00:00:00Z"}, "empty validity window"),
        ({"comment": "hi"}, "unknown field 'comment'"),
    ],
)
def test_malformed_trust_roots_are_named(
    trust_root_v1: TrustRoot, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(MalformedInputError, match=message):
        TrustRoot.from_dict(_entry(trust_root_v1, **changes))


def test_trust_root_documents_are_checked(trust_root_v1: TrustRoot) -> None:
    document = trust_root_v1.to_dict()
    with pytest.raises(MalformedInputError, match="schema must be"):
        TrustRoot.from_dict(dict(document, schema="v0"))
    with pytest.raises(MalformedInputError, match="version must be >= 1"):
        TrustRoot.from_dict(dict(document, version=0))
    with pytest.raises(MalformedInputError, match="keys is empty"):
        TrustRoot.from_dict(dict(document, keys=[]))
    with pytest.raises(MalformedInputError, match=r"lists key .* twice"):
        TrustRoot.from_dict(dict(document, keys=document["keys"] * 2))
    with pytest.raises(MalformedInputError, match="repeats the key 'version'"):
        TrustRoot.from_json('{"version": 1, "version": 2}')
