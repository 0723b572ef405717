"""The embedded default's cache: files under the data directory, shared by every process.

The rate-limit counters (``attestations/http/throttling.py``) must be shared by every gunicorn
worker, or each worker counts alone and the effective limit is the limit times the
number of workers. Redis does that in production; without Redis, Django's process-local
memory cache would not. Django's file cache is shared, but its ``add`` (check, then write)
and ``incr`` (read, then write) are not atomic across processes: two workers can both
win an ``add``, or both read 4 and write 5. Here every write and read-modify-write takes
an exclusive ``flock`` on one lock file in the cache directory, so the counters of all
processes on the host add up exactly. One host only: a multi-host deployment sets
``REDIS_URL`` (the README's configuration reference says so).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.cache.backends.filebased import FileBasedCache

LOCK_FILE = ".lock"


class SharedFileCache(FileBasedCache):
    """Django's file cache with ``add``, ``incr``, ``set`` and ``delete`` serialised by flock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # add() and incr() call set(): a thread already holding the lock must not wait for
        # itself (a second flock on a new descriptor would).
        self._held = threading.local()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        directory = str(getattr(self, "_dir"))  # noqa: B009 - FileBasedCache's, untyped
        os.makedirs(directory, 0o700, exist_ok=True)
        descriptor = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            self._held.depth = 1
            try:
                yield
            finally:
                self._held.depth = 0
        finally:
            os.close(descriptor)  # closing releases the lock

    def add(self, key: Any, value: Any, timeout: Any = None, version: Any = None) -> bool:
        with self._exclusive():
            return bool(super().add(key, value, timeout, version))

    def set(self, key: Any, value: Any, timeout: Any = None, version: Any = None) -> None:
        with self._exclusive():
            super().set(key, value, timeout, version)

    def incr(self, key: Any, delta: int = 1, version: Any = None) -> int:
        with self._exclusive():
            return int(super().incr(key, delta, version))

    def delete(self, key: Any, version: Any = None) -> bool:
        with self._exclusive():
            return bool(super().delete(key, version))
