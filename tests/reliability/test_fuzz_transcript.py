"""Hostile transcripts: the reader and the verifier fail only in their documented ways.

* ``zkdv.records.iter_records`` raises :class:`~zkdv.errors.TranscriptError` (or its
  subclass ``TruncatedTranscriptError``) for bad data, and nothing else.
* ``zkdv.verify.verify_transcript`` never raises for bad data: it returns a report with
  ``ok`` False and a reason.

Inputs: byte-level mutations of a real transcript (any change must be rejected), records
edited field by field with hostile values and re-chained as a forger would (so the
semantic checks, not the hash chain, meet them), and raw CBOR built from hostile headers
(deep nesting, huge declared lengths, invalid UTF-8, unknown tags). Sizes are bounded, so
a hang is a failure of the run, not a slow example.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.reliability.fuzz import budget
from tests.synthetic import write_synthetic_transcript
from zkdv.errors import TranscriptError
from zkdv.hashing import ZERO_DIGEST
from zkdv.records import RECORDS_FILE, encode, iter_records, record_hash
from zkdv.verify import verify_transcript


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("honest")
    write_synthetic_transcript(path, steps=5, experiment="acme/lm", spec_digest="ab" * 32)
    data = (path / RECORDS_FILE).read_bytes()
    assert verify_transcript(data, probes=False).ok
    return data


def read_all(data: bytes) -> list[dict[str, Any]] | TranscriptError:
    """The records, or the documented error; any other exception fails the test."""
    try:
        return [record.data for record in iter_records(data)]
    except TranscriptError as error:
        assert error.reason, error
        assert str(error)
        return error


def check_verifier(data: bytes) -> Any:
    """Verify; the verifier must return a report, never raise."""
    report = verify_transcript(data, probes=False)
    assert isinstance(report.ok, bool)
    if not report.ok:
        assert report.reason, report
        assert report.message, report
    # The report must serialise: the platform stores it as the verdict.
    assert report.summary()
    return report


def rechain(records: list[dict[str, Any]]) -> bytes:
    out = bytearray()
    prev = ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    return bytes(out)


# --- byte-level mutations -----------------------------------------------------------------

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.integers(0), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.integers(0), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0), st.just(0)),
    st.tuples(st.just("duplicate"), st.integers(0), st.integers(1, 400)),
)


def mutate(data: bytes, op: tuple[str, int, Any]) -> bytes:
    kind, position, arg = op
    position %= len(data)
    if kind == "flip":
        return data[:position] + bytes([data[position] ^ (1 << arg)]) + data[position + 1 :]
    if kind == "overwrite":
        return data[:position] + arg + data[position + len(arg) :]
    if kind == "insert":
        return data[:position] + arg + data[position:]
    if kind == "delete":
        return data[:position] + data[position + arg :]
    if kind == "truncate":
        return data[:position]
    return data[:position] + data[position : position + arg] + data[position:]


@budget(2)
@given(ops=st.lists(mutation, min_size=1, max_size=4))
def test_any_byte_mutation_is_rejected_in_the_documented_way(
    honest: bytes, ops: list[tuple[str, int, Any]]
) -> None:
    data = honest
    for op in ops:
        data = mutate(data, op) or b"\x00"
    read_all(data)
    report = check_verifier(data)
    if data != honest:
        assert not report.ok, f"a changed transcript verified: {ops}"


# --- field-level edits, re-chained ----------------------------------------------------------


def hostile_values() -> st.SearchStrategy[Any]:
    """Values of the wrong type, size or shape for any field."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**64), max_value=2**64),
        # A big integer: its decimal form exceeds Python's 4300-digit str() limit.
        st.builds(pow, st.just(10), st.just(5000)),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.binary(max_size=40),
        st.just(b"\x00" * 32),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(st.text(max_size=6), children, max_size=4),
        ),
        max_leaves=12,
    )


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths_of(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += paths_of(child, (*prefix, index))
    return found


def replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = replace(copy[head], rest, new)
    return copy


@budget(3)
@given(data=st.data(), new=hostile_values())
def test_hostile_field_values_never_crash_the_verifier(
    honest: bytes, data: st.DataObject, new: Any
) -> None:
    records = [record.data for record in iter_records(honest)]
    index = data.draw(st.integers(0, len(records) - 1), label="record")
    candidates = [p for p in paths_of(records[index]) if p != ("prev",)]
    path = data.draw(st.sampled_from(candidates), label="field")
    records[index] = replace(records[index], path, new)
    forged = rechain(records)
    read_all(forged)
    check_verifier(forged)


@budget(1)
@given(data=st.data())
def test_dropped_or_extra_fields_never_crash_the_verifier(
    honest: bytes, data: st.DataObject
) -> None:
    records = [record.data for record in iter_records(honest)]
    index = data.draw(st.integers(0, len(records) - 1), label="record")
    record = dict(records[index])
    keys = sorted(k for k in record if k != "prev")
    drop = data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True), label="drop")
    for key in drop:
        del record[key]
    extra = data.draw(st.dictionaries(st.text(max_size=4), hostile_values(), max_size=2))
    record.update(extra)
    records[index] = record
    forged = rechain(records)
    read_all(forged)
    check_verifier(forged)


# --- raw hostile CBOR ---------------------------------------------------------------------


def header(major: int, argument: int) -> bytes:
    if argument < 24:
        return bytes([major << 5 | argument])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if argument < 256 ** struct.calcsize(fmt):
            return bytes([major << 5 | info]) + struct.pack(fmt, argument)
    raise AssertionError(argument)


hostile_item = st.one_of(
    # Huge declared lengths for strings, arrays and maps, with little or no content.
    st.builds(
        lambda major, n, tail: header(major, n) + tail,
        st.sampled_from([2, 3, 4, 5]),
        st.sampled_from([2**16, 2**26, 2**32 - 1, 2**40, 2**63, 2**64 - 1]),
        st.binary(max_size=16),
    ),
    # Deep nesting of definite and indefinite containers and tags.
    st.builds(
        lambda opener, depth: opener * depth + b"\x00",
        st.sampled_from([b"\x81", b"\x9f", b"\xa1\x00", b"\xbf\x00", b"\xc6", b"\xd8\x1c"]),
        st.integers(1, 20_000),
    ),
    # Text strings whose bytes are not UTF-8, in a key or a value.
    st.builds(
        lambda raw, as_key: (
            b"\xa1" + header(3, len(raw)) + raw + b"\x00"
            if as_key
            else b"\xa1\x61t" + header(3, len(raw)) + raw
        ),
        st.binary(min_size=1, max_size=12).filter(lambda b: not _utf8(b)),
        st.booleans(),
    ),
    # Any tag number over any small item.
    st.builds(
        lambda tag, body: b"\xa1\x00" + header(6, tag) + body,
        st.integers(0, 2**64 - 1),
        st.binary(max_size=24),
    ),
    # Reserved additional-information values, stray break codes, bare simple values.
    st.builds(lambda b, tail: bytes([b]) + tail, st.integers(0, 255), st.binary(max_size=8)),
)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@budget(3)
@given(prefix=st.booleans(), item=hostile_item, suffix=st.binary(max_size=8))
def test_hostile_cbor_fails_in_the_documented_way(
    honest: bytes, prefix: bool, item: bytes, suffix: bytes
) -> None:
    # After a valid root record too, so the failure is met at record 1, not only at 0.
    first = next(iter_records(honest))
    data = (honest[: first.size] if prefix else b"") + item + suffix
    outcome = read_all(data)
    if isinstance(outcome, TranscriptError) and prefix:
        assert outcome.record is not None and outcome.record >= 1
    report = check_verifier(data)
    assert not report.ok


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x81" * 200_000 + b"\x00", id="nesting-200k"),
        pytest.param(header(4, 2**63), id="array-2^63-items"),
        pytest.param(header(2, 2**64 - 1), id="bytes-2^64-1"),
        pytest.param(b"\xa1" + header(3, 3) + b"\xff\xfe\xfd" + b"\x00", id="invalid-utf8-key"),
        pytest.param(b"\x9f" * 100_000, id="indefinite-nesting"),
        pytest.param(b"", id="empty"),
    ],
)
def test_named_hostile_inputs(data: bytes) -> None:
    """The cases the issue names, pinned so they run in every CI run."""
    outcome = read_all(data)
    if data:
        assert isinstance(outcome, TranscriptError)
    assert not check_verifier(data).ok


def test_a_transcript_file_that_vanishes_is_an_io_error(tmp_path: Path) -> None:
    report = verify_transcript(tmp_path / "missing" / RECORDS_FILE)
    assert not report.ok and report.reason == "io_error"
