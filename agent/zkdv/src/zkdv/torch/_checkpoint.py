"""Bounded host snapshots for Torch checked replay.

Eager optimizers update parameters and state in place. Every
``replay_snapshot_interval`` steps ZKDV copies the full pre-state (parameters,
optimizer state, buffers) into a **replay snapshot** in host memory: plain host memory
on CPU, page-locked (pinned) memory on CUDA so the copy is asynchronous. At most
``capacity`` snapshots are alive; their slots are reused, not reallocated per window. A
snapshot is kept, with the committed batches of its window, until every step it may
have to replay has retired, then dropped.

Between snapshots nothing is copied but the few rows each parameter's probe reads: a
sampled check forms the committed update from the committed post-update value and the
replayed pre-update value (:attr:`~zkdv.driver.protocol.ReplayOutcome.committed_delta`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zkdv import workers
from zkdv.torch._strides import dim_order, empty_in_order

__all__ = ["ReplayCheckpoint", "Snapshot", "StepInputs"]

State = dict[str, Any]
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class StepInputs:
    """What one step's transition reads besides the state: all of it committed.

    Attributes:
        words: the committed batch (every rank's rows).
        hyperparameters: the step's dynamic optimizer options (the record's ``hp``).
    """

    words: np.ndarray
    hyperparameters: list[dict[str, Any]] | None = None


@dataclass
class Snapshot:
    """The full pre-state of one step, in host memory."""

    step: int
    parameters: list[torch.Tensor]
    states: list[State]
    buffers: list[torch.Tensor]
    #: Set once nothing reads the host copy but replays: its file is written, or none is.
    written: threading.Event = field(default_factory=threading.Event)


def _host_like(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    # In the tensor's own memory format: a replay from a contiguous copy of channels_last
    # weights would run other kernels than training did.
    return empty_in_order(
        tensor.shape,
        dim_order(tensor),
        dtype=tensor.dtype,
        device="cpu",
        pin_memory=pinned and tensor.is_cuda,
    )


def _copy_state(state: State, slot: State | None, pinned: bool) -> State:
    out: State = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            target = slot.get(name) if slot is not None else None
            if (
                not isinstance(target, torch.Tensor)
                or target.shape != value.shape
                or target.dtype != value.dtype
                or target.stride() != value.stride()
            ):
                target = _host_like(value, pinned)
            target.copy_(value.detach(), non_blocking=pinned)
            out[name] = target
        else:
            out[name] = value
    return out


def _same_layouts(slots: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> bool:
    return len(slots) == len(tensors) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        for a, b in zip(slots, tensors, strict=True)
    )


@dataclass
class ReplayCheckpoint:
    """Snapshots and committed batches kept for sampled replays.

    Args:
        interval: ``replay_snapshot_interval``.
        capacity: the most snapshots alive at once.
        pinned: allocate page-locked host memory (CUDA state).
        files: each snapshot is also written to a file, from its host copy, on the
            driver's snapshot stage; a slot is reused only after :meth:`Snapshot.written`.
    """

    interval: int
    capacity: int
    pinned: bool = False
    files: bool = False
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    batches: dict[int, StepInputs] = field(default_factory=dict)
    _free: list[Snapshot] = field(default_factory=list)
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def start_of(self, step: int) -> int:
        """The snapshot step a replay of ``step`` starts from."""
        return step - step % self.interval

    def take(
        self,
        step: int,
        parameters: Sequence[torch.Tensor],
        states: Sequence[State],
        buffers: Sequence[torch.Tensor],
        check: Callable[[], None],
    ) -> Snapshot:
        """Copy the pre-state of ``step`` into a snapshot slot (waits for a free one)."""
        with self._lock:
            if len(self.snapshots) >= self.capacity:
                with workers.waiting():
                    while len(self.snapshots) >= self.capacity:
                        self._lock.wait(_POLL_SECONDS)
                        check()
            slot = self._free.pop() if self._free else None
        # A slot no replay needs any more may still be on its way to disk.
        if slot is not None and not slot.written.is_set():
            with workers.waiting():
                while not slot.written.wait(_POLL_SECONDS):
                    check()
        with torch.no_grad():
            if slot is not None and _same_layouts(slot.parameters, parameters):
                host_parameters = slot.parameters
            else:
                host_parameters = [_host_like(p, self.pinned) for p in parameters]
            for target, source in zip(host_parameters, parameters, strict=True):
                target.copy_(source.detach(), non_blocking=self.pinned)
            old_states = slot.states if slot is not None else [None] * len(states)
            host_states = [
                _copy_state(state, old, self.pinned)
                for state, old in zip(states, old_states, strict=True)
            ]
            if slot is not None and _same_layouts(slot.buffers, buffers):
                host_buffers = slot.buffers
            else:
                host_buffers = [_host_like(b, self.pinned) for b in buffers]
            for target, source in zip(host_buffers, buffers, strict=True):
                target.copy_(source.detach(), non_blocking=self.pinned)
        if self.pinned:
            # The copies were queued on the current stream; the snapshot is read on other
            # threads, so wait here for them (a D2H copy of the state, once per window).
            torch.cuda.current_stream().synchronize()
        snapshot = Snapshot(step, host_parameters, host_states, host_buffers)
        if not self.files:
            snapshot.written.set()
        with self._lock:
            self.snapshots[step] = snapshot
        return snapshot

    def keep_batch(self, step: int, batch: np.ndarray) -> None:
        """Keep a step's committed batch (its other inputs come with :meth:`keep_inputs`)."""
        with self._lock:
            self.batches[step] = StepInputs(batch)

    def keep_inputs(self, step: int, inputs: StepInputs) -> None:
        with self._lock:
            self.batches[step] = inputs

    def get(self, step: int) -> tuple[Snapshot, list[StepInputs]]:
        """The snapshot preceding ``step`` and the step inputs from it through ``step``.

        Raises:
            RuntimeError: they were already dropped (a bug in retirement tracking).
        """
        start = self.start_of(step)
        with self._lock:
            snapshot = self.snapshots.get(start)
            batches = [self.batches.get(index) for index in range(start, step + 1)]
        if snapshot is None or any(batch is None for batch in batches):
            raise RuntimeError(f"ZKDV dropped the replay window of step {step} too early")
        return snapshot, batches  # type: ignore[return-value]

    def prune(self, oldest_needed: int) -> None:
        """Drop what no step at or after ``oldest_needed`` can need for its replay."""
        keep = self.start_of(oldest_needed)
        with self._lock:
            for step in [step for step in self.snapshots if step < keep]:
                self._free.append(self.snapshots.pop(step))
            for step in [step for step in self.batches if step < keep]:
                del self.batches[step]
            del self._free[max(0, self.capacity - len(self.snapshots)) :]
            self._lock.notify_all()
