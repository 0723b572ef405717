"""The log's key in C2SP signed-note terms: key hash, key id and verifier key.

C2SP signed-note (https://c2sp.org/signed-note) names an Ed25519 key by
``SHA-256(key name || 0x0A || 0x01 || raw public key)``: its first four bytes prefix every
signature line, and a *verifier key* spells name, hash and key on one line::

    dvbench.example/log+5c1c2f7e+AaJ9...   (<name>+<hash hex>+<base64(0x01 || key)>)

which note-compatible tools (Go's ``golang.org/x/mod/sumdb/note.NewVerifier``, witnesses)
take as is. The key name of a DVBench log is its origin.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dvbench.attest._encoding import b64decode, b64encode
from dvbench.attest._errors import MalformedInputError

__all__ = ["NOTE_ED25519", "note_key_id", "note_verifier_key", "parse_note_verifier_key"]

#: signed-note's signature type byte for Ed25519.
NOTE_ED25519: Final = 0x01
# A key name: no spaces, no '+' (the verifier key's separator), no em dash.
_NAME = re.compile(r"[^\s+\u2014]+")
_HASH = re.compile(r"[0-9a-f]{8}")


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def note_key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    """``SHA-256(key name || 0x0A || 0x01 || raw public key)``, all 32 bytes.

    Its first four bytes are the key hash on the key's signature lines; the Sigstore
    bundle names the log by all 32 (``logId.keyId``).
    """
    material = name.encode("utf-8") + b"\n" + bytes([NOTE_ED25519]) + _raw(public_key)
    return hashlib.sha256(material).digest()


def note_verifier_key(name: str, public_key: Ed25519PublicKey) -> str:
    """``<name>+<key hash hex>+<base64(0x01 || raw public key)>``.

    Raises:
        ValueError: the name is empty or holds a space, a '+' or an em dash.
    """
    if _NAME.fullmatch(name) is None:
        raise ValueError(f"note key name {name!r} must be non-empty, without spaces or '+'")
    key_hash = note_key_id(name, public_key)[:4].hex()
    return f"{name}+{key_hash}+{b64encode(bytes([NOTE_ED25519]) + _raw(public_key))}"


def parse_note_verifier_key(
    text: object, what: str = "note verifier key"
) -> tuple[str, Ed25519PublicKey]:
    """Parse a verifier key and check that its hash is its name's and key's.

    Returns:
        The key name and the Ed25519 public key.

    Raises:
        MalformedInputError: another format, another algorithm than Ed25519, or a key
            hash that does not belong to the name and key.
    """
    if not isinstance(text, str):
        raise MalformedInputError(f"{what} must be a string, got {type(text).__name__}")
    parts = text.split("+", 2)  # base64 may hold "+" too
    if len(parts) != 3 or _NAME.fullmatch(parts[0]) is None or _HASH.fullmatch(parts[1]) is None:
        raise MalformedInputError(
            f"{what} must be '<name>+<8 lowercase hex digits>+<base64 key>', got {text!r:.120}"
        )
    blob = b64decode(parts[2], what)
    if len(blob) != 33 or blob[0] != NOTE_ED25519:
        raise MalformedInputError(f"{what} must encode 0x01 and a 32-byte Ed25519 key")
    public_key = Ed25519PublicKey.from_public_bytes(blob[1:])
    if note_key_id(parts[0], public_key)[:4].hex() != parts[1]:
        raise MalformedInputError(
            f"{what}: the key hash {parts[1]} is not the hash of its name and key"
        )
    return parts[0], public_key
