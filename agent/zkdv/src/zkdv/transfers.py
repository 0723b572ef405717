"""Bytes a frontend reads from the accelerator to the host, per step and kind.

Both frontends count every device-to-host read here (``proof.transfers``), so a test
can show that on the device path a step reads O(record size), not O(state).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["TransferLog"]


class TransferLog:
    """Bytes read from the device to the host, per step and kind (thread-safe).

    Kinds: ``"batch"``, ``"roots"``, ``"probes"``, ``"values"`` (challenged
    coordinates), ``"snapshot"`` (a replay snapshot's copy) and, on the host path,
    ``"state"`` (the post-update state and deltas read for hashing). The last
    ``keep`` steps are kept individually; :meth:`totals` covers the whole run.
    """

    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._steps: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._totals: dict[str, int] = {}

    def add(self, step: int, kind: str, nbytes: int) -> None:
        with self._lock:
            kinds = self._steps.get(step)
            if kinds is None:
                kinds = self._steps[step] = {}
                while len(self._steps) > self._keep:
                    self._steps.popitem(last=False)
            kinds[kind] = kinds.get(kind, 0) + int(nbytes)
            self._totals[kind] = self._totals.get(kind, 0) + int(nbytes)

    def step(self, step: int) -> dict[str, int]:
        """``{kind: bytes}`` read for ``step`` (one of the last ``keep`` steps)."""
        with self._lock:
            return dict(self._steps.get(step, {}))

    def total(self, step: int) -> int:
        return sum(self.step(step).values())

    def totals(self) -> dict[str, int]:
        """``{kind: bytes}`` over the whole run."""
        with self._lock:
            return dict(self._totals)
