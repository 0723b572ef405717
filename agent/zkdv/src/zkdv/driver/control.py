"""Small host decisions, independent of backend accelerator collective ordering.

In a multi-process run only rank 0 owns the transcript, so only it knows whether a step
is sampled for a check and which coordinates are challenged. Every rank must act on the
same decision, yet routing it through the framework's collectives would interleave
host control with the training step's own collectives and could deadlock when ranks
issue them in different orders. :class:`HostControl` instead sends each decision over
a dedicated TCP channel as one JSON line.

Wire protocol (one request and one response per round, each a ``\\n``-terminated
JSON line of at most :attr:`HostControl.limit` bytes)::

    follower -> owner   [rank, token, key]
    owner -> follower   {"value": decision}
                      | {"error": code, "message": text}

``code`` is one of ``token``, ``rank``, ``malformed``, ``too_large``, ``timeout`` or
``closed``. A connection that fails authentication, or sends a malformed or oversized
request, is answered with an error and closed; the owner keeps serving everyone else.
No model arrays or replay snapshots belong on this channel.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import secrets
import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from zkdv.errors import ZKDVError

__all__ = ["HostControl"]

CONTROL_CLOSED = "ZKDV host control is closed"
DEFAULT_TIMEOUT = 600.0
DEFAULT_LIMIT = 64 * 1024

# Follower-side exception per owner error code: callers branch on the type.
_ERRORS: dict[str, type[Exception]] = {
    "token": PermissionError,
    "rank": ValueError,
    "malformed": ValueError,
    "too_large": ValueError,
    "timeout": TimeoutError,
    "closed": ConnectionError,
}

# How often the acceptor notices close() if shutdown() did not wake accept().
_ACCEPT_POLL_SECONDS = 0.5
# How much of a rejected request the owner reads and discards before closing.
_DRAIN_BYTES = 1 << 20


@dataclass
class _Round:
    payload: bytes
    readers: set[int] = field(default_factory=set)


class _RequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"


class HostControl:
    """Broadcast bounded JSON decisions from the sole tape owner.

    Rank 0 (the owner) listens; every other rank (a follower) connects to it. Each
    calling thread has its own connection: a training admission must not block
    delivery of a check decision being awaited by a completion thread. Named rounds
    may therefore arrive in different orders on these independent threads; a round
    is matched by its key, not by its position in a stream.

    Args:
        rank: this process's rank; 0 is the owner.
        size: the number of processes, at least 2 (one process needs no channel).
        address: for the owner, the ``(host, port)`` to bind, default
            ``("0.0.0.0", 0)`` so followers on other hosts can connect (pass
            ``("127.0.0.1", 0)`` for a single machine); for a follower, the owner's
            address, required.
        token: the shared secret. The owner generates 32 random bytes when None; a
            follower must pass the owner's :attr:`token`.
        timeout: seconds a round may take: how long the owner waits for every
            follower to receive a decision, and a follower for the owner to send it.

    Attributes:
        address: the owner's bound address (owner) or the address to reach it.
        token: the shared secret to hand to followers.
        limit: the largest request or response line in bytes.

    Raises:
        ValueError: an invalid rank, size, timeout, or a follower without an address
            and token.
        OSError: the owner cannot bind ``address``.
    """

    limit: int = DEFAULT_LIMIT

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        address: tuple[str, int] | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if (
            isinstance(rank, bool)
            or isinstance(size, bool)
            or size < 2
            or not 0 <= rank < size
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(
                f"invalid ZKDV host-control configuration: rank={rank!r}, size={size!r}, "
                f"timeout={timeout!r}"
            )
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("a ZKDV host-control token must be a non-empty string")
        self.rank, self.size, self.timeout = int(rank), int(size), float(timeout)
        self._closed = threading.Event()
        self._ready = threading.Condition()
        self._rounds: dict[str, _Round] = {}
        self._connections: set[socket.socket] = set()
        self._connection_lock = threading.Lock()
        self._local = threading.local()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        if self.rank == 0:
            self.token = token if token is not None else secrets.token_hex(32)
            self._listener = socket.create_server(address or ("0.0.0.0", 0))  # noqa: S104 - multi-host by design
            self._listener.settimeout(_ACCEPT_POLL_SECONDS)
            host, port = self._listener.getsockname()[:2]
            self.address: tuple[str, int] = (str(host), int(port))
            self._acceptor = threading.Thread(target=self._accept, daemon=True, name="zkdv-control")
            self._acceptor.start()
        else:
            if address is None or token is None:
                raise ValueError(
                    "a ZKDV host-control follower requires the owner's address and token"
                )
            self.token = token
            self.address = (str(address[0]), int(address[1]))
        self._token = self.token.encode()

    def __repr__(self) -> str:
        role = "owner" if self.rank == 0 else "follower"
        return f"HostControl({role}, rank={self.rank}, size={self.size}, address={self.address})"

    def __enter__(self) -> HostControl:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- public API ------------------------------------------------------------------

    def exchange(self, key: str, value: Any = None) -> Any:
        """Deliver one owner decision to every follower, with bounded lifetime.

        The owner publishes ``value`` under ``key`` and blocks until every follower has
        received it. A follower blocks until the owner publishes ``key`` and returns
        that value; its own ``value`` is ignored. Every rank, the owner included,
        returns the JSON-decoded decision, so all ranks see identical values (a tuple
        comes back as a list everywhere).

        Args:
            key: the round's name, unique among rounds in flight.
            value: the owner's decision; any JSON value without NaN or infinity.

        Returns:
            The owner's decision.

        Raises:
            TimeoutError: the round did not complete within :attr:`timeout`.
            PermissionError: (follower) the owner rejected this follower's token.
            ValueError: the key is empty, or the decision or request exceeds
                :attr:`limit`, or the decision is not finite JSON.
            TypeError: the decision is not JSON-serializable.
            RuntimeError: (owner) a round with this key is already in flight.
            ConnectionError: (follower) the owner went away during the round.
            ZKDVError: this channel is closed, including while the call was blocked.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"a ZKDV control round needs a non-empty string key, got {key!r}")
        if self._closed.is_set():
            raise ZKDVError(CONTROL_CLOSED)
        if self.rank == 0:
            return self._publish(key, value)
        return self._receive(key)

    def close(self) -> None:
        """Wake blocked decisions and release every transport connection.

        Blocked :meth:`exchange` calls on this instance raise :class:`ZKDVError`.
        Calling it again does nothing.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        with self._ready:
            self._ready.notify_all()
        if self._listener is not None:
            # shutdown() wakes a thread blocked in accept() on Linux; close() alone not.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._connection_lock:
            connections = list(self._connections)
            self._connections.clear()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=2 * _ACCEPT_POLL_SECONDS)

    @classmethod
    def for_backend(cls, backend: str) -> HostControl | None:
        """Bootstrap once through the user's initialized process group.

        Rank 0 opens the channel and broadcasts ``[hostname, port, token]`` through the
        framework's own collective, which the user has already authenticated and
        connected; followers connect with that descriptor. Must be called by every
        process of the group, like any collective.

        Args:
            backend: ``"jax"`` (``jax.distributed`` must be initialized when there is
                more than one process) or ``"torch"`` (``torch.distributed``).

        Returns:
            The channel, or None for a single process (or an uninitialized torch
            process group), where there is nothing to coordinate.

        Raises:
            ValueError: an unknown backend, or a descriptor too long to broadcast.
        """
        if backend == "jax":
            import jax

            rank, size = int(jax.process_index()), int(jax.process_count())
        elif backend == "torch":
            import torch.distributed as distributed

            if not distributed.is_available() or not distributed.is_initialized():
                return None
            rank, size = int(distributed.get_rank()), int(distributed.get_world_size())
        else:
            raise ValueError(f"unsupported ZKDV control backend: {backend!r}")
        if size == 1:
            return None
        owner = cls(rank, size) if rank == 0 else None
        descriptor: Any = (
            [socket.getfqdn(), owner.address[1], owner.token] if owner is not None else None
        )
        try:
            if backend == "jax":
                descriptor = _broadcast_jax(descriptor, is_source=rank == 0)
            else:
                payload = [descriptor]
                distributed.broadcast_object_list(payload, src=0)
                descriptor = payload[0]
            if owner is not None:
                return owner
            hostname, port, token = descriptor
            return cls(rank, size, address=(str(hostname), int(port)), token=str(token))
        except BaseException:
            if owner is not None:
                owner.close()
            raise

    # -- owner -----------------------------------------------------------------------

    def _publish(self, key: str, value: Any) -> Any:
        payload = _line({"value": value})
        if len(payload) > self.limit:
            raise ValueError(
                f"ZKDV host decision {key!r} is {len(payload)} bytes; the limit is {self.limit}"
            )
        decision = json.loads(payload)["value"]
        round_ = _Round(payload)
        followers = self.size - 1
        with self._ready:
            if key in self._rounds:
                raise RuntimeError(f"duplicate ZKDV control round: {key}")
            self._rounds[key] = round_
            self._ready.notify_all()
            try:
                completed = self._ready.wait_for(
                    lambda: len(round_.readers) >= followers or self._closed.is_set(),
                    timeout=self.timeout,
                )
            finally:
                if self._rounds.get(key) is round_:
                    del self._rounds[key]
            missing = sorted(set(range(1, self.size)) - round_.readers)
        if self._closed.is_set() and missing:
            raise ZKDVError(CONTROL_CLOSED)
        if not completed:
            raise TimeoutError(
                f"ZKDV followers {missing} did not receive {key!r} within {self.timeout} s"
            )
        return decision

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            with self._connection_lock:
                if self._closed.is_set():
                    connection.close()
                    return
                self._connections.add(connection)
            threading.Thread(
                target=self._serve, args=(connection,), daemon=True, name="zkdv-control-peer"
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        # An unauthenticated peer gets `timeout` to send its first request; after that
        # a connection may idle between rounds for as long as training runs.
        authenticated = False
        try:
            connection.settimeout(self.timeout)
            with connection.makefile("rb") as stream:
                while not self._closed.is_set():
                    line = stream.readline(self.limit + 1)
                    if not line:
                        return
                    try:
                        rank, key = self._parse(line)
                    except _RequestError as error:
                        self._reject(connection, stream, error)
                        return
                    if not authenticated:
                        authenticated = True
                        connection.settimeout(None)
                    if not self._deliver(connection, rank, key):
                        return
        except OSError:
            return  # the peer vanished or close() shut the connection down
        finally:
            with self._connection_lock:
                self._connections.discard(connection)
            connection.close()

    def _parse(self, line: bytes) -> tuple[int, str]:
        if len(line) > self.limit:
            raise _RequestError(
                "too_large", f"ZKDV control requests are limited to {self.limit} bytes"
            )
        if not line.endswith(b"\n"):
            raise _RequestError("malformed", "ZKDV control request is not a complete line")
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _RequestError("malformed", "ZKDV control request is not JSON") from None
        if (
            not isinstance(request, list)
            or len(request) != 3
            or not isinstance(request[1], str)
            or not isinstance(request[2], str)
            or not request[2]
        ):
            raise _RequestError("malformed", "ZKDV control request must be [rank, token, key]")
        rank, token, key = request
        # Constant-time comparison: the token is the only thing between a network peer
        # and the run's sampling decisions.
        if not hmac.compare_digest(token.encode(), self._token):
            raise _RequestError("token", "ZKDV host control rejected the follower's token")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < self.size:
            raise _RequestError(
                "rank", f"ZKDV control follower rank {rank!r} is not in [1, {self.size})"
            )
        return rank, key

    def _deliver(self, connection: socket.socket, rank: int, key: str) -> bool:
        with self._ready:
            ready = self._ready.wait_for(
                lambda: (
                    self._closed.is_set()
                    or (key in self._rounds and rank not in self._rounds[key].readers)
                ),
                timeout=self.timeout,
            )
            round_ = None if self._closed.is_set() or not ready else self._rounds[key]
        if round_ is None:
            if self._closed.is_set():
                self._send(connection, {"error": "closed", "message": CONTROL_CLOSED})
                return False
            self._send(
                connection,
                {
                    "error": "timeout",
                    "message": f"ZKDV owner did not publish {key!r} within {self.timeout} s",
                },
            )
            return True
        connection.sendall(round_.payload)
        with self._ready:
            round_.readers.add(rank)
            self._ready.notify_all()
        return True

    def _reject(self, connection: socket.socket, stream: Any, error: _RequestError) -> None:
        self._send(connection, {"error": error.code, "message": str(error)})
        # Closing a socket with unread input makes the kernel send a reset, which can
        # destroy the error line before the peer reads it. Half-close, then discard a
        # bounded amount of the rest of the request for a bounded time.
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_WR)
            connection.settimeout(min(1.0, self.timeout))
            discarded = 0
            while discarded < _DRAIN_BYTES:
                chunk = stream.read1(self.limit)
                if not chunk:
                    break
                discarded += len(chunk)

    @staticmethod
    def _send(connection: socket.socket, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            connection.sendall(_line(message))

    # -- follower --------------------------------------------------------------------

    def _connection(self) -> tuple[socket.socket, Any]:
        existing: tuple[socket.socket, Any] | None = getattr(self._local, "connection", None)
        if existing is not None:
            return existing
        connection = socket.create_connection(self.address, timeout=self.timeout)
        with self._connection_lock:
            if self._closed.is_set():
                connection.close()
                raise ZKDVError(CONTROL_CLOSED)
            self._connections.add(connection)
        pair = (connection, connection.makefile("rb"))
        self._local.connection = pair
        return pair

    def _drop(self) -> None:
        # After any failure the stream may hold a late answer to the failed round;
        # the next round on this thread starts on a fresh connection.
        pair: tuple[socket.socket, Any] | None = getattr(self._local, "connection", None)
        self._local.connection = None
        if pair is None:
            return
        connection, stream = pair
        with self._connection_lock:
            self._connections.discard(connection)
        with contextlib.suppress(OSError):
            stream.close()
        connection.close()

    def _receive(self, key: str) -> Any:
        request = json.dumps([self.rank, self.token, key], separators=(",", ":")).encode() + b"\n"
        if len(request) > self.limit:
            raise ValueError(f"ZKDV control key is too large: the limit is {self.limit} bytes")
        try:
            connection, stream = self._connection()
            connection.sendall(request)
            response = stream.readline(self.limit + 1)
        except TimeoutError:
            self._drop()
            raise TimeoutError(f"ZKDV owner did not send {key!r} within {self.timeout} s") from None
        except OSError as error:
            self._drop()
            if self._closed.is_set():
                raise ZKDVError(CONTROL_CLOSED) from error
            raise ConnectionError(
                f"ZKDV owner connection failed during {key!r}: {error}"
            ) from error
        if not response.endswith(b"\n") or len(response) > self.limit:
            self._drop()
            if self._closed.is_set():
                raise ZKDVError(CONTROL_CLOSED)
            raise ConnectionError(f"ZKDV owner disconnected during {key!r}")
        message = json.loads(response)
        if "error" in message:
            self._drop()
            kind = _ERRORS.get(str(message["error"]), ConnectionError)
            raise kind(str(message.get("message", message["error"])))
        return message["value"]


def _broadcast_jax(descriptor: Any, *, is_source: bool) -> Any:
    """Broadcast a small JSON value from process 0 through JAX's multihost utilities."""
    import numpy as np
    from jax.experimental import multihost_utils

    encoded = json.dumps(descriptor).encode()
    if len(encoded) >= 1024:
        raise ValueError("ZKDV control address is too long")
    # A fixed-size buffer: every process must pass an array of the same shape.
    payload = np.zeros(1024, dtype=np.uint8)
    payload[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    payload = multihost_utils.broadcast_one_to_all(payload, is_source=is_source)
    return json.loads(np.asarray(payload).tobytes().rstrip(b"\0"))
