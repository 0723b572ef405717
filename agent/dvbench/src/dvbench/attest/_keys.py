"""Ed25519 signing keys, key ids, and the trust root with validity windows.

A key id is what securesystemslib's ``SSlibKey.from_crypto`` computes for the key: the
lowercase hex SHA-256 of ``{"keytype":"ed25519","keyval":{"public":"<hex raw key>"},
"scheme":"ed25519"}`` (:func:`key_id`), so anyone holding the public key can recompute
it and DSSE verifiers find the signature by it. Keys registered before that carry the
hex SHA-256 of their DER SubjectPublicKeyInfo (:func:`spki_key_id`, RFC 5280 section
4.1.2.7) in the trust roots and certificates of their day; both ids name the key.

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

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from dvbench.attest._encoding import (
    array,
    b64decode,
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
from dvbench.attest._note import note_key_id, note_verifier_key, parse_note_verifier_key
from dvbench.attest._tsa import TimestampAuthority

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
    "key_ids",
    "load_signing_key",
    "spki_key_id",
]

ALGORITHM_ED25519: Final = "ed25519"
ENV_SIGNING_KEY: Final = "DVBENCH_SIGNING_KEY"
DEFAULT_KEY_FILENAME: Final = "signing-key.pem"
TRUST_ROOT_SCHEMA: Final = "https://dvbench.dev/trust-root/v1"
# The Sigstore TrustedRoot that ``_trusted_root`` writes and ``TrustRoot.from_sigstore`` reads.
TRUSTED_ROOT_MEDIA_TYPE: Final = "application/vnd.dev.sigstore.trustedroot+json;version=0.1"


def key_id(public_key: Ed25519PublicKey) -> str:
    """The key's id: what securesystemslib's ``SSlibKey.from_crypto`` computes for it.

    The hex SHA-256 of the canonical JSON
    ``{"keytype": "ed25519", "keyval": {"public": "<hex raw key>"}, "scheme": "ed25519"}``
    (TUF and securesystemslib's default key id), so that a DSSE verifier given the key
    as ``SSlibKey.from_crypto`` derives it finds the envelope's signature by its key id.
    Keys registered before this id existed keep their :func:`spki_key_id` in the trust
    root, and both ids name the same key everywhere (:meth:`TrustRoot.key`).
    """
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    document = {"keytype": "ed25519", "keyval": {"public": raw.hex()}, "scheme": "ed25519"}
    return hashlib.sha256(canonical_json(document)).hexdigest()


def spki_key_id(public_key: Ed25519PublicKey) -> str:
    """The key id of trust roots and certificates issued before :func:`key_id` changed.

    Hex SHA-256 of the public key's DER SubjectPublicKeyInfo.
    """
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def key_ids(public_key: Ed25519PublicKey) -> tuple[str, str]:
    """Both ids of a key: :func:`key_id` and the older :func:`spki_key_id`."""
    return key_id(public_key), spki_key_id(public_key)


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
        keyid: the key's id as the trust root lists it: :func:`key_id`, or
            :func:`spki_key_id` for a key registered before that (checked on load).
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

    def has_id(self, keyid: str) -> bool:
        """Whether ``keyid`` names this key (either form, :func:`key_ids`)."""
        return keyid == self.keyid or keyid in key_ids(self.public_key)

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
        if keyid not in key_ids(public_key):
            raise MalformedInputError(
                f"{what}.keyid {keyid} is neither the key's id (securesystemslib's "
                "SSlibKey.from_crypto) nor the SHA-256 of its SubjectPublicKeyInfo"
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
        timestamp_authorities: RFC 3161 timestamp authorities, when read from a Sigstore
            trusted root (:meth:`from_sigstore`); the DVBench document does not list them.
    """

    version: int
    keys: tuple[TrustedKey, ...]
    log_origin: str | None = None
    timestamp_authorities: tuple[TimestampAuthority, ...] = ()

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
            if key.has_id(keyid):
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
        if any(key.has_id(incoming.keyid) for key in self.keys):
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
                if not key.has_id(key_id(public_key)):
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
        """Parse a trust root: the DVBench document, or a Sigstore ``trusted_root.json``."""
        document = parse_json(data, "trust root")
        if isinstance(document, Mapping) and "mediaType" in document:
            return cls.from_sigstore(document)
        return cls.from_dict(document)

    @classmethod
    def from_sigstore(cls, data: object, what: str = "trusted root") -> TrustRoot:
        """Read a Sigstore TrustedRoot v0.1 written by ``dvbench.attest.sigstore_trusted_root``.

        Its log keys are the platform's keys, with their windows (``validFor``), its
        ``baseUrl`` names the log, and its timestamp authorities are kept. It has no
        version: ``version`` is 0.

        Raises:
            MalformedInputError: the document is not such a trusted root.
        """
        document = obj(
            data,
            what,
            required=("mediaType", "tlogs"),
            optional=("certificateAuthorities", "ctlogs", "timestampAuthorities"),
        )
        if document["mediaType"] != TRUSTED_ROOT_MEDIA_TYPE:
            raise MalformedInputError(
                f"{what}.mediaType must be {TRUSTED_ROOT_MEDIA_TYPE!r}, got "
                f"{document['mediaType']!r:.80}"
            )
        keys: list[TrustedKey] = []
        origins: set[str] = set()
        for index, entry in enumerate(array(document["tlogs"], f"{what}.tlogs")):
            origin, key = _sigstore_log_key(entry, f"{what}.tlogs[{index}]")
            origins.add(origin)
            keys.append(key)
        if not keys or len(origins) != 1:
            raise MalformedInputError(f"{what}.tlogs must name one log, with at least one key")
        authorities = [
            _sigstore_timestamp_authority(entry, f"{what}.timestampAuthorities[{index}]")
            for index, entry in enumerate(
                array(document.get("timestampAuthorities", []), f"{what}.timestampAuthorities")
            )
        ]
        return cls(
            version=0,
            keys=tuple(keys),
            log_origin=origins.pop(),
            timestamp_authorities=tuple(authorities),
        )

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


def _sigstore_log_key(entry: object, where: str) -> tuple[str, TrustedKey]:
    """One ``tlogs`` entry of a Sigstore trusted root: the log's origin and its key."""
    log = obj(entry, where, required=("baseUrl", "hashAlgorithm", "publicKey", "logId"))
    base = string(log["baseUrl"], f"{where}.baseUrl")
    if not base.startswith("https://"):
        raise MalformedInputError(f"{where}.baseUrl must be https://<log origin>")
    origin = base.removeprefix("https://")
    key = obj(
        log["publicKey"],
        f"{where}.publicKey",
        required=("rawBytes", "keyDetails", "validFor"),
    )
    if key["keyDetails"] != "PKIX_ED25519":
        raise MalformedInputError(f"{where}.publicKey.keyDetails must be 'PKIX_ED25519'")
    try:
        public_key = serialization.load_der_public_key(
            b64decode(key["rawBytes"], f"{where}.publicKey.rawBytes")
        )
    except (ValueError, UnsupportedAlgorithm):
        raise MalformedInputError(f"{where}.publicKey.rawBytes is not a public key") from None
    if not isinstance(public_key, Ed25519PublicKey):
        raise MalformedInputError(f"{where}.publicKey is not an Ed25519 key")
    window = obj(
        key["validFor"],
        f"{where}.publicKey.validFor",
        required=("start",),
        optional=("end",),
    )
    not_before = parse_time(window["start"], f"{where}.publicKey.validFor.start")
    not_after = (
        parse_time(window["end"], f"{where}.publicKey.validFor.end") if "end" in window else None
    )
    log_id = obj(log["logId"], f"{where}.logId", required=("keyId",))["keyId"]
    if b64decode(log_id, f"{where}.logId.keyId") != note_key_id(origin, public_key):
        raise MalformedInputError(
            f"{where}.logId.keyId is not the signed-note key id of its key under {origin!r}"
        )
    return origin, TrustedKey.from_public_key(
        public_key, not_before=not_before, not_after=not_after
    )


def _sigstore_timestamp_authority(entry: object, where: str) -> TimestampAuthority:
    """One ``timestampAuthorities`` entry of a Sigstore trusted root."""
    item = obj(entry, where, required=("certChain", "validFor"), optional=("subject", "uri"))
    chain_data = obj(item["certChain"], f"{where}.certChain", required=("certificates",))
    chain = []
    for position, cert in enumerate(
        array(chain_data["certificates"], f"{where}.certChain.certificates")
    ):
        raw = obj(cert, f"{where}.certChain.certificates[{position}]", required=("rawBytes",))[
            "rawBytes"
        ]
        try:
            chain.append(
                x509.load_der_x509_certificate(
                    b64decode(raw, f"{where}.certChain.certificates[{position}].rawBytes")
                )
            )
        except ValueError:
            raise MalformedInputError(
                f"{where}.certChain.certificates[{position}] is not a DER certificate"
            ) from None
    if len(chain) < 2:
        raise MalformedInputError(
            f"{where}.certChain must hold the authority's certificate and its root"
        )
    window = obj(item["validFor"], f"{where}.validFor", required=("start",), optional=("end",))
    return TimestampAuthority(
        chain=tuple(chain),
        not_before=parse_time(window["start"], f"{where}.validFor.start"),
        not_after=parse_time(window["end"], f"{where}.validFor.end") if "end" in window else None,
        uri=str(item.get("uri", "")),
    )
