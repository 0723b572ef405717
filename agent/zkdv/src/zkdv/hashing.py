"""Domain-separated BLAKE3 hashing for every use in the protocol.

Each use (record, Merkle leaf, Merkle node, tensor, batch row, rolling window, sampling
decision, probe seed, file, the seeds of random operators) hashes with its own BLAKE3 key, derived once with BLAKE3's
``derive_key`` mode from the context string ``"zkdv v1 <use>"``. A digest from one use
can therefore never be replayed as a digest of another. Merkle leaves and nodes also
carry RFC 6962's ``0x00``/``0x01`` prefixes.
"""

from __future__ import annotations

from typing import Final

import blake3

__all__ = ["DIGEST_BYTES", "ZERO_DIGEST", "Domain", "hash_bytes", "hasher"]

DIGEST_BYTES: Final = 32
ZERO_DIGEST: Final = bytes(DIGEST_BYTES)


class Domain:
    RECORD: Final = "record"
    LEAF: Final = "leaf"
    NODE: Final = "node"
    TENSOR: Final = "tensor"
    BATCH: Final = "batch"
    WINDOW: Final = "window"
    SAMPLE: Final = "sample"
    PROBE: Final = "probe"
    FILE: Final = "file"
    STATE: Final = "state"
    RNG: Final = "rng"

    ALL: Final = (RECORD, LEAF, NODE, TENSOR, BATCH, WINDOW, SAMPLE, PROBE, FILE, STATE, RNG)


def _derive(use: str) -> bytes:
    return blake3.blake3(b"zkdv-protocol-v1", derive_key_context=f"zkdv v1 {use}").digest()


_KEYS: Final = {use: _derive(use) for use in Domain.ALL}
# Keyed hashers are cloned from these prototypes: copying a hasher is cheaper than
# re-deriving its key schedule on every call.
_PROTOTYPES: Final = {use: blake3.blake3(key=key) for use, key in _KEYS.items()}


def hasher(use: str) -> blake3.blake3:
    """A fresh keyed BLAKE3 hasher for ``use`` (one of :class:`Domain`)."""
    return _PROTOTYPES[use].copy()


def hash_bytes(
    use: str, *parts: bytes | bytearray | memoryview, length: int = DIGEST_BYTES
) -> bytes:
    """Hash the concatenation of ``parts`` under ``use``'s key."""
    h = _PROTOTYPES[use].copy()
    for part in parts:
        h.update(part)
    return h.digest(length=length)


def key_for(use: str) -> bytes:
    """The 32-byte key of ``use``; published so other implementations can interoperate."""
    return _KEYS[use]
