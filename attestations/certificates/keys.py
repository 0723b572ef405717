"""Signing keys and the trust root: which key signs, and which keys a verifier trusts.

The private key comes from ``DVBENCH_SIGNING_KEY_FILE`` or ``DVBENCH_SIGNING_KEY``
(production), else from ``$DVBENCH_DATA_DIR/keys/signing-key.pem``, generated once with
mode 0600. Its public half and validity window are recorded in
:class:`~attestations.certificates.models.PlatformKey`, and every change publishes a new
:class:`~attestations.certificates.models.TrustRootVersion`. A key that is not the trust
root's current key never signs (issuance fails loudly instead of issuing certificates
that no verifier would accept). :func:`rotate_key` starts a new key now and ends the
old one's window at the same second.

Key changes and log appends (``attestations/certificates/translog.py``) are serialised by
one lock, :func:`lock_log`, kept here because both need it and the log builds on the keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.serialization import load_pem_public_key
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.certificates.models import KeySource, PlatformKey, TrustRootVersion
from attestations.certificates.tsa import Authority, load_authority
from dvbench.attest import (
    DEFAULT_KEY_FILENAME,
    ENV_SIGNING_KEY,
    KeyConfigurationError,
    SigningKey,
    TrustedKey,
    TrustRoot,
    format_time,
    key_ids,
    load_signing_key,
    note_verifier_key,
    sigstore_trusted_root,
    to_seconds,
)

__all__ = [
    "Rotation",
    "current_trust_root",
    "ensure_current",
    "key_row",
    "keys_dir",
    "lock_log",
    "log_origin",
    "now",
    "rotate_key",
    "signing_key",
    "timestamp_authority",
    "trusted_key",
    "trusted_root",
    "verifier_id",
    "verifier_keys",
]

#: pg_advisory_xact_lock key of the log ("dvblog" in ASCII).
_LOG_LOCK: Final = 0x64_76_62_6C_6F_67
_KEY_FILE: Final = DEFAULT_KEY_FILENAME
_NEXT_KEY_FILE: Final = "next-signing-key.pem"


# --- configuration ----------------------------------------------------------------------


def _knob(name: str) -> str:
    value = settings.DVBENCH[name]  # type: ignore[literal-required]
    return str(value) if value else ""


def verifier_id() -> str:
    """``DVBENCH_VERIFIER_ID``: the URI naming this verifying service in certificates."""
    return _knob("VERIFIER_ID") or "https://dvbench.localhost"


def log_origin() -> str:
    """The log's name (checkpoints' first line): ``DVBENCH_LOG_ORIGIN``, else ``<host>/log``."""
    origin = _knob("LOG_ORIGIN") or f"{urlsplit(verifier_id()).netloc or 'dvbench.localhost'}/log"
    if not origin or any(character.isspace() for character in origin) or "\u2014" in origin:
        raise ImproperlyConfigured(
            f"DVBENCH_LOG_ORIGIN={origin!r} must be non-empty, without spaces or em dashes"
        )
    return origin


def keys_dir() -> Path:
    """Where generated private keys live: ``$DVBENCH_DATA_DIR/keys`` (mode 0700)."""
    return Path(settings.DVBENCH["DATA_DIR"]) / "keys"


def _configured_key() -> SigningKey | None:
    """The key from ``DVBENCH_SIGNING_KEY_FILE`` or ``DVBENCH_SIGNING_KEY``, if either is set."""
    path = _knob("SIGNING_KEY_FILE")
    if path:
        return SigningKey.from_file(path)
    text = _knob("SIGNING_KEY")
    if text:
        return load_signing_key(environ={ENV_SIGNING_KEY: text})
    return None


def _local_key() -> SigningKey:
    try:
        return load_signing_key(data_dir=keys_dir())
    except KeyConfigurationError:
        # Another process generated it between our look and our exclusive create.
        path = keys_dir() / _KEY_FILE
        if not path.exists():
            raise
        return SigningKey.from_file(path)


# --- the lock ---------------------------------------------------------------------------


def lock_log() -> None:
    """Serialise log appends and key changes until the current transaction ends."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOG_LOCK])


# --- keys and the trust root ------------------------------------------------------------


def now() -> datetime:
    """The signing clock: the current time in UTC, to the whole second."""
    return to_seconds(timezone.now().astimezone(UTC))


def trusted_key(row: PlatformKey) -> TrustedKey:
    """The stored key as a trust root's entry: its public key and validity window."""
    public_key = load_pem_public_key(row.public_key.encode("ascii"))
    return TrustedKey(
        keyid=row.keyid,
        public_key=public_key,  # type: ignore[arg-type]
        not_before=to_seconds(row.not_before),
        not_after=None if row.not_after is None else to_seconds(row.not_after),
    )


def key_row(keyid: str) -> PlatformKey:
    """The key named by either of its ids (``dvbench.attest.key_ids``).

    Keys registered before key ids followed securesystemslib's are stored under their
    SubjectPublicKeyInfo id; what they sign since names them by the new one.

    Raises:
        PlatformKey.DoesNotExist: no stored key has that id.
    """
    row = PlatformKey.objects.filter(keyid=keyid).first()
    if row is not None:
        return row
    for row in PlatformKey.objects.all():
        if keyid in key_ids(trusted_key(row).public_key):
            return row
    raise PlatformKey.DoesNotExist(f"no signing key has id {keyid}")


def _publish(root: TrustRoot) -> TrustRootVersion:
    return TrustRootVersion.objects.create(
        version=root.version, document=root.to_json().decode("utf-8"), digest=root.digest()
    )


def _latest_root_row() -> TrustRootVersion | None:
    return TrustRootVersion.objects.order_by("-version").first()


def _register_initial(key: SigningKey, source: str, *, at: datetime) -> TrustRootVersion:
    root = TrustRoot.initial(key.public_key, not_before=at, log_origin=log_origin())
    PlatformKey.objects.create(
        keyid=key.keyid, public_key=key.public_pem, not_before=at, source=source
    )
    return _publish(root)


def ensure_current(key: SigningKey, source: str) -> TrustRootVersion:
    """The trust root in force, checking that ``key`` is its current key (call under the lock).

    The very first key is registered here (trust root version 1).

    Raises:
        KeyConfigurationError: the key is retired or was never added by a rotation.
    """
    row = PlatformKey.objects.filter(keyid__in=key_ids(key.public_key)).first()
    root = _latest_root_row()
    if row is None:
        if root is None and not PlatformKey.objects.exists():
            return _register_initial(key, source, at=now())
        current = PlatformKey.objects.filter(not_after__isnull=True).first()
        raise KeyConfigurationError(
            f"the signing key {key.keyid} is not in the trust root (current key: "
            f"{current.keyid if current else 'none'}); run `manage.py rotate_signing_key` to "
            "adopt it"
        )
    if row.not_after is not None:
        raise KeyConfigurationError(
            f"the signing key {key.keyid} was retired at {row.not_after.isoformat()}; configure "
            "the current key or rotate to a new one"
        )
    assert root is not None, "a registered key always has a trust root"
    published = root.trust_root()
    if published.log_origin is None:
        # Published before trust roots named the log: the next version carries every
        # key's signed-note verifier key too (same keys, same windows).
        return _publish(published.with_log_origin(log_origin()))
    return root


def signing_key() -> tuple[SigningKey, str]:
    """The key that signs now and where it came from (configured, else the generated one)."""
    configured = _configured_key()
    if configured is not None:
        return configured, KeySource.CONFIGURED
    return _local_key(), KeySource.GENERATED


def current_trust_root() -> TrustRootVersion:
    """The latest published trust root, registering the first key if there is none yet."""
    row = _latest_root_row()
    if row is not None:
        return row
    with transaction.atomic():
        lock_log()
        key, source = signing_key()
        return ensure_current(key, source)


@dataclass(frozen=True)
class Rotation:
    """What :func:`rotate_key` did."""

    old_keyid: str | None
    new_keyid: str
    at: datetime
    trust_root: TrustRootVersion


def rotate_key(new_key: SigningKey | None = None, *, actor: Any = None) -> Rotation:
    """Start a new signing key now and end the current key's window at the same second.

    With a configured key (``DVBENCH_SIGNING_KEY_FILE`` / ``DVBENCH_SIGNING_KEY``) the
    configured key is adopted: put the new key there first, then rotate. Otherwise
    ``new_key`` (imported) or a freshly generated key replaces
    ``$DVBENCH_DATA_DIR/keys/signing-key.pem``; the retired private key is deleted, since
    it may never sign again. The rotation instant is the next whole second, so every
    certificate already signed in this second stays inside the old key's window.

    Raises:
        KeyConfigurationError: the configured key is already current, or a key was given
            while one is configured.
    """
    configured = _configured_key()
    if configured is not None and new_key is not None:
        raise KeyConfigurationError(
            "a signing key is configured (DVBENCH_SIGNING_KEY_FILE or DVBENCH_SIGNING_KEY): "
            "put the new key there and rotate without --key-file"
        )
    incoming = configured or new_key or SigningKey.generate()
    source = (
        KeySource.CONFIGURED
        if configured is not None
        else KeySource.IMPORTED
        if new_key is not None
        else KeySource.GENERATED
    )
    staged: Path | None = None
    if configured is None:
        staged = _stage_key(incoming)
    try:
        with transaction.atomic():
            lock_log()
            rotation = _rotate_rows(incoming, source)
            AuditEvent.record(
                "signing_key.rotated",
                actor=actor,
                detail={
                    "old_keyid": rotation.old_keyid,
                    "new_keyid": rotation.new_keyid,
                    "at": rotation.at.isoformat(),
                    "trust_root_version": rotation.trust_root.version,
                },
            )
            if staged is not None:
                # Inside the transaction: if the rename fails, the rotation rolls back.
                os.replace(staged, keys_dir() / _KEY_FILE)
                staged = None
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    return rotation


def _stage_key(key: SigningKey) -> Path:
    folder = keys_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / _NEXT_KEY_FILE
    path.unlink(missing_ok=True)  # a leftover of a rotation that failed half-way
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.private_pem())
    return path


def _rotate_rows(incoming: SigningKey, source: str) -> Rotation:
    root_row = _latest_root_row()
    if PlatformKey.objects.filter(keyid__in=key_ids(incoming.public_key)).exists():
        raise KeyConfigurationError(
            f"key {incoming.keyid} is already in the trust root: put a new key into "
            "DVBENCH_SIGNING_KEY_FILE / DVBENCH_SIGNING_KEY first"
        )
    # The next whole second, and after the current key's start (two rotations within one
    # second would otherwise give the current key an empty window).
    at = now() + timedelta(seconds=1)
    started = PlatformKey.objects.filter(not_after__isnull=True).values_list(
        "not_before", flat=True
    )
    for not_before in started:
        at = max(at, to_seconds(not_before) + timedelta(seconds=1))
    if root_row is None:
        published = _register_initial(incoming, source, at=at)
        return Rotation(old_keyid=None, new_keyid=incoming.keyid, at=at, trust_root=published)
    current = PlatformKey.objects.filter(not_after__isnull=True).first()
    try:
        previous = root_row.trust_root()
        if previous.log_origin is None:
            previous = replace(previous, log_origin=log_origin())
        root = previous.rotate(incoming.public_key, at=at)
    except ValueError as error:
        raise KeyConfigurationError(f"cannot rotate: {error}") from None
    PlatformKey.objects.filter(not_after__isnull=True).update(not_after=at)
    PlatformKey.objects.create(
        keyid=incoming.keyid, public_key=incoming.public_pem, not_before=at, source=source
    )
    published = _publish(root)
    return Rotation(
        old_keyid=current.keyid if current else None,
        new_keyid=incoming.keyid,
        at=at,
        trust_root=published,
    )


# --- the trust root as auditors read it ----------------------------------------------


def timestamp_authority() -> Authority:
    """The platform's RFC 3161 timestamp authority (``keys/tsa.pem``, made on first use)."""
    return load_authority(keys_dir())


def trusted_root() -> dict[str, Any]:
    """The trust root as a Sigstore TrustedRoot v0.1 (``dvbench.attest._trusted_root``).

    The latest published trust root's keys (as the log's keys, with their windows, which
    a rotation updates) and the timestamp authority.
    """
    root = current_trust_root().trust_root()
    return sigstore_trusted_root(
        root,
        log_origin=log_origin(),
        timestamp_authorities=[timestamp_authority().descriptor()],
    )


def verifier_keys() -> dict[str, Any]:
    """The log's keys as signed-note verifier keys (``<origin>+<hash>+<base64 key>``).

    Returns:
        ``{origin, verifier_key, keys}``: the current key's verifier key (None before the
        first key exists) and every key's, with its validity window.
    """
    origin = log_origin()
    keys = []
    current = None
    for row in PlatformKey.objects.order_by("not_before"):
        trusted = trusted_key(row)
        vkey = note_verifier_key(origin, trusted.public_key)
        if row.not_after is None:
            current = vkey
        keys.append(
            {
                "keyid": row.keyid,
                "note_verifier_key": vkey,
                "not_before": format_time(trusted.not_before),
                "not_after": None if trusted.not_after is None else format_time(trusted.not_after),
            }
        )
    return {"origin": origin, "verifier_key": current, "keys": keys}
