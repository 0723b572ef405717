"""Strict encodings shared by every attestation document.

Strictness is a security property here: each value has exactly one accepted spelling,
so a flipped bit can never decode to the same meaning. Base64 must be canonical (no
stray padding bits), hex is lowercase, times are whole UTC seconds, and objects carry
exactly the fields their schema names.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dvbench.attest._errors import MalformedInputError

_HEX = re.compile(r"[0-9a-f]*")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def canonical_json(document: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no insignificant whitespace.

    The encoding of the spec digests (:func:`dvbench.spec_digest`, which the platform's
    ``attestations.experiments.models.ExperimentSpec.compute_digest`` calls). For
    documents holding only strings, integers, booleans and null it is the RFC 8785 (JCS)
    encoding; floats are written with Python's shortest round-trip ``repr``.
    """
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def b64encode(data: bytes) -> str:
    """Standard, padded base64 (RFC 4648 section 4)."""
    return base64.b64encode(data).decode("ascii")


def b64decode(text: object, what: str) -> bytes:
    """Decode canonical base64, standard or URL-safe alphabet, padded or not.

    DSSE (protocol.md) requires verifiers to accept both alphabets. Every other
    liberty is refused: the text must be exactly what re-encoding the bytes gives, so
    unused trailing bits and misplaced padding are errors rather than aliases.

    Raises:
        MalformedInputError: ``text`` is not a string or not canonical base64.
    """
    if not isinstance(text, str):
        raise MalformedInputError(f"{what} must be a base64 string, got {type(text).__name__}")
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise MalformedInputError(f"{what} is not base64: non-ASCII characters") from None
    urlsafe = b"-" in raw or b"_" in raw
    standard = raw.replace(b"-", b"+").replace(b"_", b"/")
    if urlsafe and (b"+" in raw or b"/" in raw):
        raise MalformedInputError(f"{what} mixes the standard and URL-safe base64 alphabets")
    padded = standard + b"=" * (-len(standard) % 4)
    try:
        data = base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedInputError(f"{what} is not valid base64") from None
    canonical = base64.b64encode(data)
    if canonical != padded:
        raise MalformedInputError(f"{what} is not canonical base64 (non-zero padding bits)")
    return data


def hex_decode(text: object, what: str, *, size: int | None = None) -> bytes:
    """Decode lowercase hex, optionally of an exact byte length.

    Raises:
        MalformedInputError: not a string, not lowercase hex, or the wrong length.
    """
    if not isinstance(text, str) or _HEX.fullmatch(text) is None or len(text) % 2:
        raise MalformedInputError(f"{what} must be a lowercase hex string, got {text!r:.80}")
    if size is not None and len(text) != 2 * size:
        raise MalformedInputError(f"{what} must be {size} bytes ({2 * size} hex digits)")
    return bytes.fromhex(text)


def sha256_hex(value: object, what: str) -> str:
    """A SHA-256 digest in lowercase hex (32 bytes), returned as given.

    Raises:
        MalformedInputError: as :func:`hex_decode`.
    """
    hex_decode(value, what, size=32)
    assert isinstance(value, str)
    return value


def format_time(moment: datetime) -> str:
    """RFC 3339 UTC time with whole seconds, e.g. ``2026-11-29T12:00:00Z``.

    Raises:
        ValueError: ``moment`` is naive (no time zone) or has sub-second precision.
    """
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"time {moment!r} must be timezone-aware")
    if moment.microsecond:
        raise ValueError(f"time {moment.isoformat()} must be whole seconds")
    return moment.astimezone(UTC).strftime(_TIME_FORMAT)


def to_seconds(moment: datetime) -> datetime:
    """``moment`` in UTC with the sub-second part dropped; naive times are refused."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"time {moment!r} must be timezone-aware")
    return moment.astimezone(UTC).replace(microsecond=0)


def parse_time(text: object, what: str) -> datetime:
    """Parse the one spelling :func:`format_time` writes.

    Raises:
        MalformedInputError: any other spelling.
    """
    if not isinstance(text, str) or _TIME.fullmatch(text) is None:
        raise MalformedInputError(
            f"{what} must be an RFC 3339 UTC time like 2026-01-31T12:00:00Z, got {text!r:.80}"
        )
    try:
        return datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise MalformedInputError(f"{what} is not a calendar time: {text!r}") from None


# --- schema helpers: each names the offending field -------------------------------------


def obj(
    value: object, what: str, *, required: Sequence[str], optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    """``value`` as a JSON object with exactly the ``required`` (and allowed ``optional``) keys."""
    if not isinstance(value, Mapping):
        raise MalformedInputError(f"{what} must be a JSON object, got {type(value).__name__}")
    keys = set(value)
    missing = [key for key in required if key not in keys]
    if missing:
        raise MalformedInputError(f"{what} lacks field {missing[0]!r}")
    unknown = sorted(str(key) for key in keys - set(required) - set(optional))
    if unknown:
        raise MalformedInputError(f"{what} has unknown field {unknown[0]!r}")
    return value


def string(value: object, what: str, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise MalformedInputError(f"{what} must be a string, got {type(value).__name__}")
    if not empty and not value:
        raise MalformedInputError(f"{what} must not be empty")
    return value


def integer(value: object, what: str, *, minimum: int = 0) -> int:
    # bool is an int subclass in Python; JSON true is not a number.
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedInputError(f"{what} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise MalformedInputError(f"{what} must be >= {minimum}, got {value}")
    return value


def array(value: object, what: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise MalformedInputError(f"{what} must be a JSON array, got {type(value).__name__}")
    return value


def parse_json(data: bytes | str, what: str) -> Any:
    """Parse JSON, refusing NaN/Infinity and duplicate keys.

    Raises:
        MalformedInputError: the text is not strict JSON.
    """

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise MalformedInputError(f"{what} repeats the key {key!r}")
            result[key] = value
        return result

    def no_constants(name: str) -> Any:
        raise MalformedInputError(f"{what} holds the non-JSON number {name}")

    try:
        return json.loads(data, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except MalformedInputError:
        raise
    except RecursionError:
        raise MalformedInputError(f"{what} is nested too deeply") from None
    except ValueError as error:
        # JSONDecodeError, UnicodeDecodeError, and integers beyond Python's digit limit.
        raise MalformedInputError(f"{what} is not valid JSON: {error}") from None
