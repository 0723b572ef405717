"""The platform's challenge key: the one secret every challenge seed derives from.

A seed is ``HMAC-SHA256(K, context || run digest)`` (:func:`attestations.challenges.draw.challenge_seed`)
under one key for the whole platform, so the same run gets the same plan in every
organisation (docs/provers.md, "Challenges cannot be ground"). The key comes from
``DVBENCH_CHALLENGE_KEY_FILE`` (a mounted secret) or ``DVBENCH_CHALLENGE_KEY`` (hex), else
it is generated once into ``$DVBENCH_DATA_DIR/keys/challenge-key`` (mode 0600), as the
signing key is. Every process that draws (the ingest workers) must read the same key;
the embedded default and ``compose.yaml`` share one data directory.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

#: The file the embedded default generates under ``$DVBENCH_DATA_DIR/keys``.
KEY_FILE = "challenge-key"
#: The fewest bytes a challenge key may have (HMAC-SHA256's output size).
MIN_KEY_BYTES = 32


def parse_key(text: str, where: str) -> bytes:
    """A key written as hex, at least 32 bytes; ``ImproperlyConfigured`` naming ``where``."""
    value = text.strip()
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ImproperlyConfigured(
            f"{where} must be hex (at least {2 * MIN_KEY_BYTES} hex digits), "
            f"got {len(value)} characters that are not"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ImproperlyConfigured(
            f"{where} must hold at least {MIN_KEY_BYTES} bytes ({2 * MIN_KEY_BYTES} hex "
            f"digits), got {len(key)}"
        )
    return key


def _generated(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # Made before, or by another process between our look and our exclusive create.
        return parse_key(path.read_text(), str(path))
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(MIN_KEY_BYTES) + "\n")
    return parse_key(path.read_text(), str(path))


def challenge_key() -> bytes:
    """The platform-wide challenge key (never shown, never in the database).

    Raises:
        ImproperlyConfigured: the configured file is missing or the key is not hex of at
            least 32 bytes.
    """
    knobs = settings.DVBENCH
    configured = str(knobs.get("CHALLENGE_KEY_FILE") or "")
    if configured:
        try:
            text = Path(configured).read_text()
        except OSError as error:
            raise ImproperlyConfigured(
                f"DVBENCH_CHALLENGE_KEY_FILE={configured!r} cannot be read: {error.strerror}"
            ) from None
        return parse_key(text, "DVBENCH_CHALLENGE_KEY_FILE")
    text = str(knobs.get("CHALLENGE_KEY") or "")
    if text:
        return parse_key(text, "DVBENCH_CHALLENGE_KEY")
    return _generated(Path(knobs["DATA_DIR"]) / "keys" / KEY_FILE)
