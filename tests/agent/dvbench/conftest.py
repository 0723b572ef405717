"""A real platform for the SDK tests: pytest-django's live server, actors, a fault proxy.

* ``alice``: trainer in ``acme``        * ``bob``: auditor in ``acme``
* ``mallory``: trainer in ``evil``, an outsider to ``acme``

``platform.key("alice")`` is a real API key; ``FaultProxy`` sits between the SDK and the
live server and drops connections mid-body, answers 503s or hangs, as a test asks.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.synthetic import write_synthetic_transcript
from zkdv.files import batch_path, write_batch

ACTORS = {"alice": ("acme", "trainer"), "bob": ("acme", "auditor"), "mallory": ("evil", "trainer")}


@pytest.fixture(autouse=True)
def _isolated_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the developer's credentials or cache, and retries are quick."""
    for name in ("DVBENCH_BASE_URL", "DVBENCH_API_KEY", "DVBENCH_MODE", "DVBENCH_PART_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("DVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DVBENCH_RETRY_BACKOFF", "0.01")
    monkeypatch.setenv("DVBENCH_RETRY_MAX_DELAY", "0.2")
    monkeypatch.setenv("DVBENCH_UPLOAD_INTERVAL", "0.05")
    monkeypatch.setenv("DVBENCH_TIMEOUT", "30")
    # The live server shares one in-memory SQLite connection between its threads, and
    # concurrent writes there fail ("database table is locked") or deadlock: one request
    # at a time. The concurrent uploader is tested through a proxy that serialises
    # requests (test_sdk_upload.py).
    monkeypatch.setenv("DVBENCH_UPLOAD_CONCURRENCY", "1")
    # These tests exercise the upload machinery on every file of a proof directory; the
    # default (only the files the platform's challenges ask for) is tested apart.
    monkeypatch.setenv("DVBENCH_UPLOAD_FILES", "all")


@dataclass
class Platform:
    url: str
    media: Path
    keys: dict[str, str] = field(default_factory=dict)

    def key(self, actor: str) -> str:
        return self.keys[actor]

    def blob(self, sha256: str) -> bytes:
        from attestations.uploads.models import Blob

        return (self.media / Blob.objects.get(sha256=sha256).storage_name).read_bytes()


@pytest.fixture
def platform(live_server: Any, transactional_db: None, settings: Any, tmp_path: Path) -> Platform:
    """The live server with storage in ``tmp_path``, three actors and their API keys."""
    from django.contrib.auth.models import User

    from attestations.accounts.models import ApiKey, Membership, Organization

    media = tmp_path / "media"
    media.mkdir()
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(media)},
        },
    }
    settings.DVBENCH = {
        **settings.DVBENCH,
        "DATA_DIR": tmp_path,
        "MAX_PART_BYTES": 64 * 1024,
        "MAX_BLOB_BYTES": 16 * 1024 * 1024,
        # The SDK tests file synthetic runs (tests/synthetic.py), which commit no program; the
        # platform rejects those by default (no_program), so these tests opt out.
        "REQUIRE_PROGRAM": False,
    }
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    orgs = {
        slug: Organization.objects.create(slug=slug, name=slug.title())
        for slug in {org for org, _ in ACTORS.values()}
    }
    result = Platform(url=live_server.url, media=media)
    for username, (org, role) in ACTORS.items():
        user = User.objects.create_user(username, f"{username}@example.org", "pw-not-used-1")
        Membership.objects.create(user=user, organization=orgs[org], role=role)
        _, result.keys[username] = ApiKey.issue(user, "sdk tests")
    return result


# --- a stand-in driver ---------------------------------------------------------------


class FakeDriver:
    """The parts of zkdv.driver.Driver that DVBench relies on."""

    def __init__(self, path, config=None, *, max_in_flight: int = 2) -> None:
        self.path = Path(path)
        self.config = config
        self.max_in_flight = max_in_flight
        self.bound: tuple[str, str] | None = None
        self.digest: bytes | None = None
        self.steps = 0
        self.closed = 0

    def bind_experiment(self, name: str, spec_digest: str) -> None:
        self.bound = (name, spec_digest)

    def start(self, rolling_window: int, probe_ratio: float = 0.01) -> None:
        self.window = rolling_window

    def step(self) -> None:
        import numpy as np

        batch = np.random.default_rng(self.steps).integers(0, 9, (4, 300), dtype=np.uint32)
        write_batch(batch_path(self.path, self.steps), batch)
        self.steps += 1

    def close(self) -> None:
        if not self.closed:
            assert self.bound is not None
            write_synthetic_transcript(
                self.path, steps=3, experiment=self.bound[0], spec_digest=self.bound[1]
            )
            self.digest = b"\x01" * 32
        self.closed += 1


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> type[FakeDriver]:
    """experiment.proof() makes a FakeDriver, whatever the backend."""
    monkeypatch.setattr("dvbench._proof.backend_class", lambda backend: FakeDriver)
    return FakeDriver


# --- a fault-injecting HTTP proxy -------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    body_bytes: int
    action: str


Rule = Callable[[str, str, int], str]
"""``rule(method, path, n)`` -> ``"pass"``, ``"cut"``, ``"503"``, ``"429"``, ``"hang"`` or
``"slow"`` or ``"lie"``;
``n`` counts earlier requests with the same method and path."""


class FaultProxy:
    """An HTTP/1.1 proxy in front of the live server that misbehaves on request.

    Each request is forwarded on a fresh upstream connection and answered with
    ``Connection: close``, so every request is one decision of ``rule``:

    * ``cut``: forward the head and half the body, then close both sides: a connection
      lost in the middle of a part;
    * ``503`` / ``429``: answer that status with ``Retry-After: 0``, never forwarding;
    * ``hang``: read the request and never answer (until the proxy stops);
    * ``slow``: wait ``slow_seconds`` before forwarding: a slow network;
    * ``hold``: set ``holding`` and forward only once ``released`` is set: a network
      as slow as the test wants, without timing anything;
    * ``lie``: swallow the request and answer 200 (a part the server never got).
    """

    def __init__(self, upstream: str, rule: Rule | None = None, *, serial: bool = False) -> None:
        match = re.match(r"https?://([^:/]+):(\d+)", upstream)
        assert match, upstream
        self.upstream = (match.group(1), int(match.group(2)))
        self.rule: Rule = rule or (lambda method, path, n: "pass")
        self.slow_seconds = 0.5
        # With serial=True one request at a time reaches the live server, however many
        # the client sends at once.
        self._upstream_lock = threading.Lock() if serial else contextlib.nullcontext()
        self.max_concurrent = 0
        self._active = 0
        self.seen: list[Seen] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.holding = threading.Event()
        self.released = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._server.close()

    def puts(self, action: str | None = None) -> list[Seen]:
        return [
            s for s in self.seen if s.method == "PUT" and (action is None or s.action == action)
        ]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = [line for line in lines[1:] if line]
            length = 0
            for line in headers:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            with self._lock:
                n = self._counts.get((method, path), 0)
                self._counts[(method, path)] = n + 1
                action = self.rule(method, path, n)
                self.seen.append(Seen(method, path, length, action))
            if action in ("503", "429"):
                status = "503 Service Unavailable" if action == "503" else "429 Too Many Requests"
                payload = b'{"error": {"code": "unavailable", "message": "try again"}}'
                conn.sendall(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Retry-After: 0\r\nContent-Length: {len(payload)}\r\n"
                    "Connection: close\r\n\r\n".encode()
                    + payload
                )
                return
            if action == "lie":
                # Swallow the body and claim success: the part never reaches the server.
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
                )
                return
            if action == "hang":
                self._stop.wait()
                return
            if action == "slow":
                self._stop.wait(self.slow_seconds)
            if action == "hold":
                self.holding.set()
                while not self.released.wait(0.05) and not self._stop.is_set():
                    pass
            while len(body) < length and action != "cut":
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            kept = [h for h in headers if not h.lower().startswith(("connection:", "keep-alive"))]
            request = "\r\n".join([lines[0], *kept, "Connection: close"]).encode() + b"\r\n\r\n"
            with self._lock:
                self._active += 1
                self.max_concurrent = max(self.max_concurrent, self._active)
            try:
                response = self._forward(action, request, body, length)
            finally:
                with self._lock:
                    self._active -= 1
            if response is not None:
                conn.sendall(response)
        except OSError:
            pass
        finally:
            conn.close()

    def _forward(self, action: str, request: bytes, body: bytes, length: int) -> bytes | None:
        with self._upstream_lock, socket.create_connection(self.upstream, timeout=30) as up:
            if action == "cut":
                up.sendall(request + body[: max(1, length // 2)])
                # The server sees the body end early. Its answer is read (and dropped:
                # the client's connection just closes) before the lock is released, so
                # with serial=True the next request never overlaps this one's handling.
                up.shutdown(socket.SHUT_WR)
                while up.recv(65536):
                    pass
                return None
            up.sendall(request + body)
            response = b""
            while chunk := up.recv(65536):
                response += chunk
            return response


@pytest.fixture
def proxy(platform: Platform) -> Iterator[Callable[..., FaultProxy]]:
    made: list[FaultProxy] = []

    def make(rule: Rule | None = None, *, serial: bool = False) -> FaultProxy:
        made.append(FaultProxy(platform.url, rule, serial=serial))
        return made[-1]

    yield make
    for p in made:
        p.close()
