"""A one-line upload progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "ProgressCallback", "format_bytes"]

#: Called as ``callback(done, total)`` with bytes done (sent, resumed or deduplicated) and
#: bytes expected (0 while unknown), after every part and every deduplicated file.
ProgressCallback = Callable[[int, int], None]


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class Progress:
    """Counts bytes sent and deduplicated; redraws a ``\\r`` line at most 10 times a second.

    Args:
        total: bytes expected (sent plus deduplicated plus already on the platform).
        enabled: draw at all; default: only when ``stream`` is a terminal, so logs and
            CI output never fill with carriage returns.
        stream: where to draw (stderr).
        callback: also told every change, as ``callback(done, total)``, whether or not
            the bar is drawn: from the uploading threads, one call at a time (keep it
            quick), ``done`` never decreasing.
    """

    def __init__(
        self,
        total: int = 0,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        callback: ProgressCallback | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = total
        self.sent = 0
        self.skipped = 0
        self.deduplicated = 0
        self.deduplicated_files = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._width = 0
        self._label = ""
        self._lock = threading.Lock()
        self.callback = callback

    @property
    def done(self) -> int:
        return self.sent + self.skipped + self.deduplicated

    def label(self, text: str) -> None:
        self._label = text
        self._draw()

    def add(self, sent: int) -> None:
        with self._lock:
            self.sent += sent
        self._changed()

    def skip(self, count: int) -> None:
        """Bytes the platform already had from an interrupted earlier attempt."""
        with self._lock:
            self.skipped += count
        self._changed()

    def dedup(self, count: int) -> None:
        """A whole file the platform already stores under its content address."""
        with self._lock:
            self.deduplicated += count
            self.deduplicated_files += 1
        self._changed()

    def _changed(self) -> None:
        if self.callback is not None:
            # Read and reported under the lock: calls never go back in ``done``.
            with self._lock:
                self.callback(self.done, self.total)
        self._draw()

    @property
    def rate(self) -> float:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        return self.sent / elapsed

    def line(self) -> str:
        done = self.done
        text = f"dvbench: {format_bytes(done)}"
        if self.total:
            text += f" / {format_bytes(self.total)} ({100 * done / self.total:.0f}%)"
        text += f"  {format_bytes(self.rate)}/s"
        if self.deduplicated_files:
            text += (
                f"  dedup {format_bytes(self.deduplicated)} in {self.deduplicated_files} file(s)"
            )
        if self.skipped:
            text += f"  resumed {format_bytes(self.skipped)}"
        if self._label:
            text += f"  {self._label}"
        return text

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        text = self.line()
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._label = "done"
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
