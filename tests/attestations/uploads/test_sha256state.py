"""The resumable SHA-256 agrees with hashlib however the message is cut and saved."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from attestations.uploads import sha256state
from attestations.uploads.sha256state import ResumableSHA256

pytestmark = pytest.mark.skipif(
    not sha256state.available(), reason="Python's OpenSSL is not reachable here"
)


def test_a_state_saved_anywhere_resumes_to_hashlibs_digest() -> None:
    draw = random.Random(7)
    for _ in range(300):
        message = os.urandom(draw.randrange(0, 4 * 64 + 3))
        cuts = sorted(draw.randrange(0, len(message) + 1) for _ in range(draw.randrange(4)))
        state, start = sha256state.initial_state(), 0
        for end in [*cuts, len(message)]:
            digest = ResumableSHA256(state)
            digest.update(message[start:end])
            state, start = digest.state(), end
        resumed = ResumableSHA256(state)
        assert resumed.length == len(message)
        assert resumed.hexdigest() == hashlib.sha256(message).hexdigest()


def test_it_takes_bytes_bytearrays_and_views() -> None:
    message = bytearray(os.urandom(3 << 20))
    digest = ResumableSHA256()
    digest.update(bytes(message[:100]))
    digest.update(memoryview(message)[100 : 1 << 20])  # writable: hashed in place
    digest.update(memoryview(bytes(message))[1 << 20 :])  # read-only: copied
    assert digest.hexdigest() == hashlib.sha256(message).hexdigest()
    # Taking the digest leaves the state as it was.
    digest.update(b"more")
    assert digest.hexdigest() == hashlib.sha256(bytes(message) + b"more").hexdigest()


def test_a_damaged_state_is_refused() -> None:
    digest = ResumableSHA256()
    digest.update(b"x" * 70)
    state = digest.state()
    with pytest.raises(ValueError, match="pending bytes"):
        ResumableSHA256(state[:-1])
    with pytest.raises(ValueError, match="version"):
        ResumableSHA256(b"\x09" + state[1:])
    with pytest.raises(ValueError, match="version"):
        ResumableSHA256(b"")
