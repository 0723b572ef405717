"""Keys as a platform named them before :func:`dvbench.attest.key_id` changed: an
internal API for the platform's tests.

A platform whose key, trust root and certificates predate securesystemslib key ids
listed and signed with :func:`dvbench.attest.spki_key_id`; the platform's test that such
a key keeps signing (``tests/attestations/certificates``) issues with one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dvbench.attest import _keys

__all__ = ["spki_key_ids"]


@contextmanager
def spki_key_ids() -> Iterator[None]:
    """While open, a :class:`~dvbench.attest.SigningKey` and a trust root's keys
    (:meth:`~dvbench.attest.TrustedKey.from_public_key`) are named by their SPKI id
    (:func:`dvbench.attest.spki_key_id`), for every caller in the process; restored on
    exit."""
    key_id = _keys.key_id
    _keys.key_id = _keys.spki_key_id
    try:
        yield
    finally:
        _keys.key_id = key_id
