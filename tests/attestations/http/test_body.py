"""A request body read into reused buffers: under gunicorn straight from the socket,
leaving the connection where gunicorn's parser expects it; under other servers through
the stream Django gives.

The gunicorn tests drive gunicorn's own request parser over a real socket pair."""

from __future__ import annotations

import io
import os
import socket
import threading
from collections.abc import Iterator

import pytest
from gunicorn.config import Config
from gunicorn.http.parser import RequestParser

from attestations.http.body import RequestBody, request_body


def _request(path: str, body: bytes) -> bytes:
    return f"PUT {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    yield client, server
    client.close()
    server.close()


def _send(client: socket.socket, data: bytes, close: bool = False) -> threading.Thread:
    def run() -> None:
        client.sendall(data)
        if close:
            client.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=run)
    sender.start()
    return sender


def _read_all(body: RequestBody, buffer_size: int) -> bytes:
    buffer = bytearray(buffer_size)
    out = bytearray()
    while count := body.readinto(buffer):
        out += buffer[:count]
    return bytes(out)


@pytest.mark.parametrize("buffer_size", [1, 1000, 1 << 20])
# A small body arrives with its headers and the next request in gunicorn's first read.
@pytest.mark.parametrize("body_size", [100, 3 << 20])
def test_under_gunicorn_the_body_is_read_whole_and_the_next_request_follows(
    connection: tuple[socket.socket, socket.socket], buffer_size: int, body_size: int
) -> None:
    client, server = connection
    payload = os.urandom(body_size)
    # A kept-alive client may send its next request right behind the body.
    sender = _send(client, _request("/first", payload) + _request("/second", b"next body"))
    parser = RequestParser(Config(), server, ("127.0.0.1", 1))
    first = next(parser)
    body = request_body({"wsgi.input": first.body}, len(payload), fallback=None)

    assert _read_all(body, buffer_size) == payload
    assert first.body.reader.length == 0  # gunicorn's count of what is left
    second = next(parser)
    assert second.path == "/second"
    assert second.body.read() == b"next body"
    sender.join()


def test_a_body_that_ends_early_reads_short_and_gunicorn_does_not_reuse_the_connection(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    client, server = connection
    head = b"PUT /cut HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n"
    sender = _send(client, head + b"x" * 1200, close=True)
    request = next(RequestParser(Config(), server, ("127.0.0.1", 1)))
    body = request_body({"wsgi.input": request.body}, 5000, fallback=None)

    assert _read_all(body, 4096) == b"x" * 1200
    assert request.body.reader.length == 3800
    sender.join()


def test_a_receive_that_fails_marks_gunicorn_s_body_failed(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    client, server = connection
    sender = _send(client, b"PUT /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n")
    request = next(RequestParser(Config(), server, ("127.0.0.1", 1)))
    server.settimeout(0.05)
    body = request_body({"wsgi.input": request.body}, 100, fallback=None)

    with pytest.raises(TimeoutError):
        body.readinto(bytearray(10))
    assert request.body.failed
    sender.join()


def test_a_body_read_from_already_is_read_through_the_fallback(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    client, server = connection
    sender = _send(client, _request("/read", b"0123456789"))
    request = next(RequestParser(Config(), server, ("127.0.0.1", 1)))
    assert request.body.read(4) == b"0123"
    rest = io.BytesIO(request.body.read())

    body = request_body({"wsgi.input": request.body}, 10, fallback=rest)

    assert _read_all(body, 3) == b"456789"
    sender.join()


def test_other_servers_are_read_through_readinto_or_read() -> None:
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self.data = io.BytesIO(data)

        def read(self, size: int) -> bytes:
            return self.data.read(size)

    data = os.urandom(5000)
    assert _read_all(request_body({}, 5000, io.BytesIO(data)), 999) == data
    assert _read_all(request_body({"wsgi.input": io.BytesIO()}, 5000, ReadOnly(data)), 999) == data
    assert request_body({}, 5000, ReadOnly(data)).read(7) == data[:7]
