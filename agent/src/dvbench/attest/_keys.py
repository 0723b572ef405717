"""Ed25519 signing keys, key ids, and the trust root with validity windows.

A key id is the lowercase hex SHA-256 of the public key's DER SubjectPublicKeyInfo
(RFC 5280 section 4.1.2.7; RFC 8410 section 4 for Ed25519), so anyone holding the
public key can recompute it.

The private key comes, in this order, from an explicit PEM file, from the PEM text of
an environment variable (``DVBENCH_SIGNING_KEY`` by default), or from a file generated
once under a data directory with mode 0600. Keys never live in the repository.

The trust root is a versioned JSON document listing every key the platform has ever
signed with, each with the window in which it may sign::

    {
      "schema": "https://dvbench.dev/trust-root/v1",
      "version": 2,
      "keys": [
        {"keyid": "9f1c...", "algorithm": "ed25519",
         "public_key": "-----BEGIN PUBLIC KEY-----\\n...\\n-----END PUBLIC KEY-----\\n",
         "not_before": "2026-01-01T00:00:00Z", "not_after": "2026-07-01T00:00:00Z"},
        {"keyid": "03ab...", "algorithm": "ed25519", "public_key": "...",
         "not_before": "2026-07-01T00:00:00Z", "not_after": null}
      ]
    }

A key is valid at time ``t`` when ``not_before <= t < not_after`` (``null`` means no end
yet). Signatures are judged at the signing time written inside the signed document,
never at the time of verification, so certificates outlive the rotation of their key.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from dvbench.attest._encoding import (
    array,
    canonical_json,
    format_time,
    hex_decode,
    integer,
    obj,
    parse_json,
    parse_time,
    string,
    to_seconds,
)
from dvbench.attest._errors import (
    InvalidSignatureError,
    KeyConfigurationError,
    KeyNotValidError,
    MalformedInputError,
    UnknownKeyError,
)
from dvbench.attest._note import note_verifier_key, parse_note_verifier_key

__all__ = [
    "ALGORITHM_ED25519",
    "DEFAULT_KEY_FILENAME",
    "ENV_SIGNING_KEY",
    "TRUST_ROOT_SCHEMA",
    "Signer",
    "SigningKey",
    "TrustRoot",
    "TrustedKey",
    "key_id",
    "load_signing_key",
]

ALGORITHM_ED25519: Final = "ed25519"
ENV_SIGNING_KEY: Final = "DVBENCH_SIGNING_KEY"
DEFAULT_KEY_FILENAME: Final = "signing-key.pem"
TRUST_ROOT_SCHEMA: Final = "https://dvbench.dev/trust-root/v1"


def key_id(public_key: Ed25519PublicKey) -> str:
    """Hex SHA-256 of the public key's DER SubjectPublicKeyInfo."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def _public_pem(public_key: Ed25519PublicKey) -> str:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


@runtime_checkable
class Signer(Protocol):
    """What signs envelopes and checkpoints: a key id and raw Ed25519 signing.

    :class:`SigningKey` implements it; an HSM- or KMS-backed signer can too.
    """

    @property
    def keyid(self) -> str: ...

    @property
    def public_key(self) -> Ed25519PublicKey: ...

    def sign(self, data: bytes) -> bytes: ...


class SigningKey:
    """An Ed25519 private key and its key id.

    Args:
        private_key: the key itself.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._public_key = private_key.public_key()
        self._keyid = key_id(self._public_key)

    def __repr__(self) -> str:
        # Never the key material: reprs end up in logs.
        return f"SigningKey(keyid={self._keyid!r})"

    @property
    def keyid(self) -> str:
        """Hex SHA-256 of the public key's SubjectPublicKeyInfo DER."""
        return self._keyid

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._public_key

    @property
    def public_pem(self) -> str:
        """The public key as PEM SubjectPublicKeyInfo text."""
        return _public_pem(self._public_key)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature (RFC 8032 section 5.1.6) over ``data``."""
        return self._private_key.sign(data)

    def private_pem(self) -> bytes:
        """Unencrypted PKCS#8 PEM, for writing to a 0600 file or a secret store."""
        return self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh key from the operating system's CSPRNG."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes | str, *, password: bytes | None = None) -> SigningKey:
        """Load an Ed25519 private key from PEM text (PKCS#8, optionally encrypted).

        Raises:
            KeyConfigurationError: the text is not an Ed25519 private key in PEM.
        """
        data = pem.encode("utf-8") if isinstance(pem, str) else pem
        try:
            key = serialization.load_pem_private_key(data, password=password)
        except (ValueError, TypeError, UnsupportedAlgorithm) as error:
            raise KeyConfigurationError(f"not a PEM private key: {error}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyConfigurationError(
                f"the signing key must be Ed25519, got {type(key).__name__}"
            )
        return cls(key)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, password: bytes | None = None
    ) -> SigningKey:
        """Load a PEM private key file.

        Raises:
            KeyConfigurationError: the file cannot be read or holds no Ed25519 key.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise KeyConfigurationError(f"cannot read signing key file {path}: {error}") from None
        try:
            return cls.from_pem(data, password=password)
        except KeyConfigurationError as error:
            raise KeyConfigurationError(f"signing key file {path}: {error.message}") from None

    @classmethod
    def generate_file(
        cls, directory: str | os.PathLike[str], name: str = DEFAULT_KEY_FILENAME
    ) -> SigningKey:
        """Generate a key into ``directory/name`` with mode 0600, never overwriting.

        The directory is created with mode 0700 if missing. The file is created with
        ``O_EXCL`` and mode 0600 in one system call, so no other user can ever read it,
        not even between creation and a later ``chmod``.

        Raises:
            KeyConfigurationError: the file exists already or cannot be written.
        """
        folder = Path(directory)
        path = folder / name
        key = cls.generate()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyConfigurationError(f"refusing to overwrite the signing key {path}") from None
        except OSError as error:
            raise KeyConfigurationError(f"cannot create signing key {path}: {error}") from None
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(key.private_pem())
        return key


def load_signing_key(
    *,
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    env_var: str = ENV_SIGNING_KEY,
    data_dir: str | os.PathLike[str] | None = None,
) -> SigningKey:
    """The platform's signing key, from the first source that is configured.

    1. ``path``: a PEM file (production: a mounted secret).
    2. ``environ[env_var]``: PEM text in an environment variable.
    3. ``data_dir``: ``data_dir/signing-key.pem``, generated (0600) on first use; the
       embedded default, which keeps the key beside the data it signs.

    Args:
        path: a PEM private key file.
        environ: the environment to read; ``os.environ`` when None.
        env_var: the variable holding PEM text.
        data_dir: where the default key lives.

    Returns:
        The key.

    Raises:
        KeyConfigurationError: the configured source is unusable, or none is configured.
    """
    if path is not None:
        return SigningKey.from_file(path)
    env = os.environ if environ is None else environ
    text = env.get(env_var)
    if text:
        try:
            return SigningKey.from_pem(text)
        except KeyConfigurationError as error:
            raise KeyConfigurationError(f"{env_var}: {error.message}") from None
    if data_dir is not None:
        default = Path(data_dir) / DEFAULT_KEY_FILENAME
        if default.exists():
            return SigningKey.from_file(default)
        return SigningKey.generate_file(data_dir)
    raise KeyConfigurationError(
        f"no signing key configured: give a PEM file, set {env_var} to PEM text, "
        "or give a data directory to generate one in"
    )


@dataclass(frozen=True)
class TrustedKey:
    """One public key of the trust root and the window in which it may sign.

    Attributes:
        keyid: hex SHA-256 of the SubjectPublicKeyInfo DER (checked on load).
        public_key: the Ed25519 public key.
        not_before: first second at which the key may sign.
        not_after: first second at which it may no longer sign; None while current.
    """

    keyid: str
    public_key: Ed25519PublicKey
    not_before: datetime
    not_after: datetime | None = None

    @classmethod
    def from_public_key(
        cls,
        public_key: Ed25519PublicKey,
        *,
        not_before: datetime,
        not_after: datetime | None = None,
    ) -> TrustedKey:
        """Build an entry, computing the key id and truncating times to seconds."""
        return cls(
            keyid=key_id(public_key),
            public_key=public_key,
            not_before=to_seconds(not_before),
            not_after=None if not_after is None else to_seconds(not_after),
        )

    def valid_at(self, moment: datetime) -> bool:
        """Whether ``not_before <= moment < not_after``."""
        if moment < self.not_before:
            return False
        return self.not_after is None or moment < self.not_after

    def check_valid_at(self, moment: datetime, what: str = "signature") -> None:
        """Raise unless the key may sign at ``moment``.

        Raises:
            KeyNotValidError: ``moment`` is outside the key's validity window.
        """
        if not self.valid_at(moment):
            until = "open" if self.not_after is None else format_time(self.not_after)
            raise KeyNotValidError(
                f"{what} by key {self.keyid} claims signing time {format_time(to_seconds(moment))}, "
                f"outside the key's validity window [{format_time(self.not_before)}, {until})"
            )

    def verify(self, signature: bytes, data: bytes, what: str = "signature") -> None:
        """Check an Ed25519 signature (RFC 8032 section 5.1.7).

        Raises:
            InvalidSignatureError: the signature does not verify.
        """
        try:
            self.public_key.verify(signature, data)
        except InvalidSignature:
            raise InvalidSignatureError(
                f"{what} by key {self.keyid} does not verify (the signed bytes or the signature were altered)"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "keyid": self.keyid,
            "algorithm": ALGORITHM_ED25519,
            "public_key": _public_pem(self.public_key),
            "not_before": format_time(self.not_before),
            "not_after": None if self.not_after is None else format_time(self.not_after),
        }

    @classmethod
    def from_dict(cls, data: object, what: str = "key") -> TrustedKey:
        """Parse and check one trust-root entry.

        Raises:
            MalformedInputError: a field is missing, unknown or malformed, the algorithm is
                not Ed25519, the key id is not the SHA-256 of the key, or the window is empty.
        """
        entry = obj(
            data, what, required=("keyid", "algorithm", "public_key", "not_before", "not_after")
        )
        keyid = string(entry["keyid"], f"{what}.keyid")
        hex_decode(keyid, f"{what}.keyid", size=32)
        algorithm = entry["algorithm"]
        if algorithm != ALGORITHM_ED25519:
            raise MalformedInputError(
                f"{what}.algorithm must be {ALGORITHM_ED25519!r}, got {algorithm!r}"
            )
        pem = string(entry["public_key"], f"{what}.public_key")
        try:
            public_key = serialization.load_pem_public_key(pem.encode("utf-8"))
        except (ValueError, TypeError, UnicodeEncodeError, UnsupportedAlgorithm):
            raise MalformedInputError(f"{what}.public_key is not a PEM public key") from None
        if not isinstance(public_key, Ed25519PublicKey):
            raise MalformedInputError(f"{what}.public_key is not an Ed25519 key")
        if pem != _public_pem(public_key):
            # One spelling per key: a re-wrapped or commented PEM would be an alias.
            raise MalformedInputError(f"{what}.public_key is not in canonical PEM form")
        if key_id(public_key) != keyid:
            raise MalformedInputError(
                f"{what}.keyid {keyid} is not the SHA-256 of its public key's SubjectPublicKeyInfo"
            )
        not_before = parse_time(entry["not_before"], f"{what}.not_before")
        not_after = (
            None
            if entry["not_after"] is None
            else parse_time(entry["not_after"], f"{what}.not_after")
        )
        if not_after is not None and not_after <= not_before:
            raise MalformedInputError(
                f"{what} has an empty validity window (not_after <= not_before)"
            )
        return cls(keyid=keyid, public_key=public_key, not_before=not_before, not_after=not_after)


@dataclass(frozen=True)
class TrustRoot:
    """Every key the platform has signed with, and when each was valid.

    Attributes:
        version: increases by one with every change (rotation, retirement).
        keys: the keys, oldest first.
        log_origin: the transparency log's name. When set, every key is also given in
            signed-note's verifier-key format under that name (``note_verifier_key``),
            for note-compatible tools; None in trust roots published before it existed.
    """

    version: int
    keys: tuple[TrustedKey, ...]
    log_origin: str | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for key in self.keys:
            if key.keyid in seen:
                raise MalformedInputError(f"trust root lists key {key.keyid} twice")
            seen.add(key.keyid)

    @classmethod
    def initial(
        cls, public_key: Ed25519PublicKey, *, not_before: datetime, log_origin: str | None = None
    ) -> TrustRoot:
        """Version 1, holding one current key."""
        return cls(
            version=1,
            keys=(TrustedKey.from_public_key(public_key, not_before=not_before),),
            log_origin=log_origin,
        )

    def note_verifier_key(self, keyid: str) -> str:
        """Key ``keyid`` as a signed-note verifier key named after the log.

        Raises:
            UnknownKeyError: the trust root does not list the key.
            ValueError: the trust root names no log origin.
        """
        if self.log_origin is None:
            raise ValueError(f"trust root version {self.version} names no log origin")
        return note_verifier_key(self.log_origin, self.key(keyid).public_key)

    def with_log_origin(self, origin: str) -> TrustRoot:
        """The next version, naming ``origin`` as the log (same keys and windows)."""
        note_verifier_key(origin, self.keys[0].public_key)  # validates the name
        return replace(self, version=self.version + 1, log_origin=origin)

    def key(self, keyid: str) -> TrustedKey:
        """The entry for ``keyid``.

        Raises:
            UnknownKeyError: the trust root does not list it.
        """
        for key in self.keys:
            if key.keyid == keyid:
                return key
        raise UnknownKeyError(f"key {keyid} is not in the trust root (version {self.version})")

    def rotate(self, public_key: Ed25519PublicKey, *, at: datetime) -> TrustRoot:
        """A new version in which ``public_key`` signs from ``at`` and every open key stops then.

        Args:
            public_key: the incoming key.
            at: the moment of rotation (truncated to seconds).

        Returns:
            The next version; this one is unchanged.

        Raises:
            ValueError: the key is listed already, or ``at`` precedes an open key's start.
        """
        moment = to_seconds(at)
        incoming = TrustedKey.from_public_key(public_key, not_before=moment)
        if any(key.keyid == incoming.keyid for key in self.keys):
            raise ValueError(f"key {incoming.keyid} is already in the trust root")
        keys: list[TrustedKey] = []
        for key in self.keys:
            if key.not_after is None:
                if moment <= key.not_before:
                    raise ValueError(
                        f"rotation time {format_time(moment)} must follow key {key.keyid}'s start"
                    )
                key = replace(key, not_after=moment)
            keys.append(key)
        keys.append(incoming)
        return TrustRoot(version=self.version + 1, keys=tuple(keys), log_origin=self.log_origin)

    def to_dict(self) -> dict[str, Any]:
        keys = [key.to_dict() for key in self.keys]
        if self.log_origin is not None:
            for entry, key in zip(keys, self.keys, strict=True):
                entry["note_verifier_key"] = note_verifier_key(self.log_origin, key.public_key)
        return {"schema": TRUST_ROOT_SCHEMA, "version": self.version, "keys": keys}

    def to_json(self) -> bytes:
        """The canonical JSON bytes (what :meth:`digest` hashes)."""
        return canonical_json(self.to_dict())

    def digest(self) -> str:
        """Hex SHA-256 of :meth:`to_json`; certificates name the trust root they were issued under."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_dict(cls, data: object, what: str = "trust root") -> TrustRoot:
        """Parse and check a trust root document.

        Raises:
            MalformedInputError: the document breaks the schema in the module docstring.
        """
        document = obj(data, what, required=("schema", "version", "keys"))
        if document["schema"] != TRUST_ROOT_SCHEMA:
            raise MalformedInputError(
                f"{what}.schema must be {TRUST_ROOT_SCHEMA!r}, got {document['schema']!r:.80}"
            )
        version = integer(document["version"], f"{what}.version", minimum=1)
        entries = array(document["keys"], f"{what}.keys")
        if not entries:
            raise MalformedInputError(f"{what}.keys is empty")
        keys: list[TrustedKey] = []
        names: set[str | None] = set()
        for index, entry in enumerate(entries):
            where = f"{what}.keys[{index}]"
            plain = dict(entry) if isinstance(entry, Mapping) else entry
            vkey = plain.pop("note_verifier_key", None) if isinstance(plain, dict) else None
            key = TrustedKey.from_dict(plain, where)
            name: str | None = None
            if vkey is not None:
                name, public_key = parse_note_verifier_key(vkey, f"{where}.note_verifier_key")
                if key_id(public_key) != key.keyid:
                    raise MalformedInputError(
                        f"{where}.note_verifier_key is another key than {where}.public_key"
                    )
            names.add(name)
            keys.append(key)
        if len(names) != 1:
            raise MalformedInputError(
                f"{what}: every key or none must carry a note_verifier_key, all under one log name"
            )
        return cls(version=version, keys=tuple(keys), log_origin=names.pop())

    @classmethod
    def from_json(cls, data: bytes | str) -> TrustRoot:
        return cls.from_dict(parse_json(data, "trust root"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustRoot:
        """Read a trust root file.

        Raises:
            MalformedInputError: the file cannot be read or parsed.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise MalformedInputError(f"cannot read trust root {path}: {error}") from None
        return cls.from_json(data)
