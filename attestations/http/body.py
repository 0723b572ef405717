"""A request body read into the caller's own buffer.

A part upload moves up to a gigabyte through one request. Read the usual way,
``wsgi.input.read(n)``, every megabyte arrives as a new bytes object: gunicorn receives
it into fresh memory, copies it into its buffer and out again. On this project's 2-core
bench that cost more of the web worker's CPU per uploaded GiB than both SHA-256 passes
together: fresh pages faulted in for every megabyte, and three copies where the kernel's
one copy into reused memory does.

:func:`request_body` wraps a request's body in a :class:`RequestBody`, whose
``readinto`` fills a buffer the caller reuses. Under gunicorn it first hands out what the
request parser already holds, then receives the rest of the body straight from the
socket with ``recv_into``, counting the bytes off gunicorn's own count of the body's
remaining length: the connection is left exactly where gunicorn expects it (a kept-alive
connection's next request parses as before). Under any other server (Django's test
client, ``runserver``, another WSGI server) it reads through the stream's ``readinto``
or ``read``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["RequestBody", "request_body"]


class RequestBody:
    """A body of known length, read with ``readinto`` (or ``read``)."""

    def __init__(self, readinto: Callable[[memoryview], int]) -> None:
        self._readinto = readinto

    def readinto(self, buffer: bytearray | memoryview) -> int:
        """Fill the start of ``buffer``; the count of bytes read, 0 at the body's end."""
        view = memoryview(buffer).cast("B")
        return self._readinto(view) if len(view) else 0

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        count = self.readinto(buffer)
        return bytes(buffer[:count])


def request_body(environ: dict[str, Any], length: int, fallback: Any) -> RequestBody:
    """The body, of ``length`` bytes (its Content-Length), of the request of ``environ``.

    ``fallback`` (Django's request stream) is read when the server is not gunicorn, or
    when something has read from the body already.
    """
    direct = _gunicorn_readinto(environ.get("wsgi.input"), length)
    if direct is not None:
        return RequestBody(direct)
    readinto = getattr(fallback, "readinto", None)
    if readinto is not None:
        return RequestBody(readinto)
    return RequestBody(lambda view: _copy_read(fallback, view))


def _copy_read(stream: Any, view: memoryview) -> int:
    data = stream.read(len(view))
    view[: len(data)] = data
    return len(data)


def _gunicorn_readinto(stream: Any, length: int) -> Callable[[memoryview], int] | None:
    """``readinto`` for gunicorn's body of a request with a Content-Length, none of it
    read yet; None for anything else (a chunked body, a body read from already, another
    server, a gunicorn whose reader differs)."""
    try:
        from gunicorn.http.body import Body, LengthReader
        from gunicorn.http.unreader import SocketUnreader
    except ImportError:  # another server
        return None
    if type(stream) is not Body or type(stream.reader) is not LengthReader:
        return None
    body: Any = stream
    reader: Any = stream.reader
    unreader: Any = reader.unreader
    if type(unreader) is not SocketUnreader or not hasattr(unreader, "take_buffered"):
        return None
    if reader.length != length or body.buf.tell():
        return None

    def held(view: memoryview) -> int:
        """Bytes gunicorn's parser read ahead and holds, not yet counted off the length
        (the body's own buffer is empty: checked above, and only gunicorn's ``read``
        fills it); anything past the body is the next request's, and goes back."""
        data = unreader.take_buffered()
        if not data:
            return 0
        count: int = min(len(data), len(view), reader.length)
        view[:count] = data[:count]
        reader.length -= count
        if count < len(data):
            unreader.unread(data[count:])
        return count

    def readinto(view: memoryview) -> int:
        try:
            count = held(view)
            if count:
                return count
            want = min(len(view), reader.length)
            if want <= 0:
                return 0
            received: int = unreader.sock.recv_into(view[:want])
            reader.length -= received
            return received
        except Exception:
            # Where the next request starts on the connection is unknown now: gunicorn
            # must not reuse it (its own reader marks the body so, too).
            body.failed = True
            raise

    return readinto
