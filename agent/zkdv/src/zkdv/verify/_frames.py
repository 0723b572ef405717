"""The transcript's bytes, framed into records: each record's span, hash and fields.

:func:`frames` is :func:`~zkdv.records.iter_records` for the verifier's loop: the same
framing and the same errors, without an object per record.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

import cbor2

from zkdv.errors import TranscriptError
from zkdv.hashing import Domain, hasher
from zkdv.records import MAX_RECORD_BYTES, RECORDS_FILE, iter_records

_RECORD_HASHER = hasher(Domain.RECORD)


def transcript_bytes(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
) -> memoryview:
    """The transcript's bytes, from any source :func:`iter_records` reads."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return memoryview(source)
    if hasattr(source, "read"):
        return memoryview(source.read())
    path = Path(source)
    if path.is_dir():
        path = path / RECORDS_FILE
    return memoryview(path.read_bytes())


def frames(view: memoryview) -> Iterator[tuple[int, int, bytes, dict[str, Any]]]:
    """``(offset, end, hash, record)`` of each record: :func:`iter_records`, less its
    object per record (and measurably faster than decoding inline in the verifier's
    loop). A record the reader would refuse gets the reader's own precise error."""
    total = len(view)
    stream = io.BytesIO(view)
    decode = cbor2.CBORDecoder(stream).decode
    tell = stream.tell
    new_hash = _RECORD_HASHER.copy
    offset = 0
    while offset < total:
        try:
            data = decode()
        except Exception:  # noqa: BLE001 - the reader names the failure precisely
            _reader_error(view)
        end = tell()
        if type(data) is not dict or end - offset > MAX_RECORD_BYTES:
            _reader_error(view)
        hasher = new_hash()
        hasher.update(view[offset:end])
        yield offset, end, hasher.digest(), data
        offset = end


def _reader_error(view: memoryview) -> NoReturn:
    """Raise the error :func:`iter_records` gives for the first record it refuses."""
    for _ in iter_records(view):
        pass
    raise TranscriptError("malformed_record", "the transcript's framing is malformed")
