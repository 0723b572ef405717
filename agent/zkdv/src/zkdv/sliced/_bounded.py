"""Bounded reading of the sliced wire format: counts and sizes checked before decoding.

A run file or an opening comes from the lab, and the platform reads it inside a request
or a worker. ``cbor2.loads`` of a whole document materialises everything it says before
any check could look at it: 2 MB of empty arrays became 137 MiB of Python lists (a 72x
inflation), and a list header may claim 2**64 items. So a document is read here field by
field and, for the fields that are lists, element by element:

* the top-level map's keys are read first, and a key the format does not know is
  refused;
* a list's length is read from its CBOR header and compared with the field's limit
  before any element is decoded;
* each value (or element) is walked header by header, without decoding it, by
  :func:`skip`, which counts its data items, its nesting and its string lengths and
  stops at the first one over the field's limit; only then is that one span decoded
  (``cbor2.loads`` of its bytes) and converted to the compact object the caller keeps.

The walk is linear in the number of data items and never recurses; a string is skipped
by its length, not read. Tags, indefinite lengths and reserved values, which canonical
CBOR and this format never use, are refused. Every refusal is a
:class:`~zkdv.sliced.SlicedFormatError` naming the field, the limit and what was found.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cbor2

_MAP = 5
_ARRAY = 4
_TAG = 6
_TEXT = 3
#: The longest key a document may have (the format's longest is 14 characters).
_KEY_BYTES = 32


class SlicedFormatError(ValueError):
    """Bytes that are not a well-formed run file, answer or opening.

    ``field`` names where (``steps[2].grad``, ``rows[5].data``), so the message can say
    which record and which field, and what was expected. A refusal for size names the
    limit (``limit``) and, where it is known before decoding, what was found (``got``).
    """

    def __init__(
        self, field: str, message: str, *, limit: int | None = None, got: int | None = None
    ) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message
        self.limit = limit
        self.got = got


@dataclass(frozen=True)
class Field:
    """How one top-level field of a document is read.

    Attributes:
        items: the most CBOR data items in the value, or in each element of a list.
        depth: the deepest nesting of containers in the value (or in each element).
        string: the longest byte or text string in it, in bytes.
        limit: None for a single value; else the value is a list of at most ``limit``
            elements, each walked and decoded on its own.
        read: for a list, what each decoded element becomes (``read(value, where,
            index)``, raising :class:`SlicedFormatError`), so that only the compact
            result is kept; None keeps the decoded element.
    """

    items: int
    depth: int = 4
    string: int = 4096
    limit: int | None = None
    read: Callable[[Any, str, int], Any] | None = None


_ENDS_INSIDE = "not canonical CBOR: the document ends inside it"
_INDEFINITE = "not canonical CBOR: an indefinite length or a reserved value"


def _head(buf: bytes, pos: int, where: str) -> tuple[int, int, int]:
    """``(major type, argument, position after the head)`` of the item at ``pos``."""
    if pos >= len(buf):
        raise SlicedFormatError(where, _ENDS_INSIDE)
    initial = buf[pos]
    major, info = initial >> 5, initial & 31
    if info < 24:
        return major, info, pos + 1
    if info > 27:
        raise SlicedFormatError(where, _INDEFINITE)
    size = 1 << (info - 24)
    if pos + 1 + size > len(buf):
        raise SlicedFormatError(where, _ENDS_INSIDE)
    return major, int.from_bytes(buf[pos + 1 : pos + 1 + size], "big"), pos + 1 + size


def skip(buf: bytes, pos: int, where: str, field: Field) -> int:
    """The end of the item at ``pos``, walked without decoding it, within ``field``'s limits.

    Raises:
        SlicedFormatError: more than ``field.items`` data items, containers nested deeper
            than ``field.depth``, a string longer than ``field.string`` bytes, a tag, an
            indefinite length, or bytes that end inside the item.
    """
    items, depth, longest = field.items, field.depth, field.string
    # remaining[k]: items still to walk at nesting level k (a map's pairs count twice).
    remaining = [1]
    count = 0
    end = len(buf)
    # _head, inlined: this loop runs once per data item of every step of a run file.
    while remaining:
        if not remaining[-1]:
            remaining.pop()
            continue
        remaining[-1] -= 1
        count += 1
        if count > items:
            raise SlicedFormatError(
                where, f"more than {items} CBOR data items, the most it may hold", limit=items
            )
        if pos >= end:
            raise SlicedFormatError(where, _ENDS_INSIDE)
        initial = buf[pos]
        major, argument = initial >> 5, initial & 31
        pos += 1
        if argument >= 24:
            if argument > 27:
                raise SlicedFormatError(where, _INDEFINITE)
            size = 1 << (argument - 24)
            if pos + size > end:
                raise SlicedFormatError(where, _ENDS_INSIDE)
            argument = int.from_bytes(buf[pos : pos + size], "big")
            pos += size
        if major in (2, _TEXT):
            if argument > longest:
                raise SlicedFormatError(
                    where,
                    f"a string of {argument} bytes is over the {longest} it may have",
                    limit=longest,
                    got=argument,
                )
            if argument > end - pos:
                raise SlicedFormatError(where, _ENDS_INSIDE)
            pos += argument
        elif major in (_ARRAY, _MAP):
            if argument:
                if len(remaining) > depth:
                    raise SlicedFormatError(
                        where, f"nested deeper than the {depth} levels it may have", limit=depth
                    )
                remaining.append(argument * 2 if major == _MAP else argument)
        elif major == _TAG:
            raise SlicedFormatError(where, "a CBOR tag, which this format never uses")
    return pos


def _decode(buf: bytes, start: int, end: int, where: str) -> Any:
    try:
        return cbor2.loads(buf[start:end])
    except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError) as error:
        raise SlicedFormatError(where, f"not canonical CBOR: {error}") from None


def read_document(
    data: bytes | bytearray | memoryview, what: str, fields: Mapping[str, Field]
) -> dict[str, Any]:
    """The top-level map of ``data``, each field read within its :class:`Field`'s limits.

    Missing fields are the caller's to check (their names are its error messages).

    Raises:
        SlicedFormatError: anything over a limit, a key the format does not have, a key
            given twice, malformed CBOR, or bytes after the document.
    """
    buf = data if isinstance(data, bytes) else bytes(data)
    major, pairs, pos = _head(buf, 0, what)
    if major != _MAP:
        raise SlicedFormatError(what, f"expected a map with the keys {', '.join(fields)}")
    if pairs > len(fields):
        raise SlicedFormatError(
            what,
            f"a map of {pairs} keys; a {what} has {len(fields)}",
            limit=len(fields),
            got=pairs,
        )
    body: dict[str, Any] = {}
    for _ in range(pairs):
        key_end = skip(buf, pos, what, Field(items=1, depth=0, string=_KEY_BYTES))
        key = _decode(buf, pos, key_end, what)
        if not isinstance(key, str) or key not in fields:
            shown = repr(key)[: _KEY_BYTES + 2]
            raise SlicedFormatError(what, f"{shown} is not a key of a {what}")
        if key in body:
            raise SlicedFormatError(key, "the key is given twice")
        body[key], pos = _read_field(buf, key_end, key, fields[key])
    if pos != len(buf):
        raise SlicedFormatError(what, f"{len(buf) - pos} bytes after the end of the document")
    return body


def _read_field(buf: bytes, pos: int, key: str, field: Field) -> tuple[Any, int]:
    if field.limit is None:
        end = skip(buf, pos, key, field)
        return _decode(buf, pos, end, key), end
    major, count, pos = _head(buf, pos, key)
    if major != _ARRAY:
        raise SlicedFormatError(key, f"expected a list of at most {field.limit} items")
    if count > field.limit:
        raise SlicedFormatError(
            key,
            f"a list of {count} items is over the {field.limit} it may have",
            limit=field.limit,
            got=count,
        )
    values = []
    for index in range(count):
        where = f"{key}[{index}]"
        end = skip(buf, pos, where, field)
        value = _decode(buf, pos, end, where)
        values.append(field.read(value, where, index) if field.read is not None else value)
        pos = end
    return values, pos
