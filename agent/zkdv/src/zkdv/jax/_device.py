"""The JAX frontend's device path and snapshot pool (docs/jax.md, section 11).

* :class:`DeviceCommitter`: the compiled chunk-root and probe programs of one proof,
  dispatched on the training thread right after the step (the state never leaves the
  device for them), and the one place the commit stage reads results back.
* :class:`TransferLog`: every device-to-host read the frontend makes, in bytes per step
  and kind. A non-snapshot step on the device path reads its batch, 32 bytes per leaf
  of each state tree, its probes and, when sampled, two values.
* :class:`SnapshotPool`: host buffers for replay snapshots, allocated once (two slots,
  primed before the first step) and reused: one precompiled program copies the whole
  state into a free slot, which it donates, and a background dispatcher launches it so
  the training thread waits only until JAX has registered the read of the state
  (seed 000: "a bounded JAX host pool is primed before training and donated into
  periodic copy outputs").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zkdv import transfers
from zkdv.device_merkle import roots_to_bytes, state_commitment
from zkdv.jax._tree import selection_cast
from zkdv.jax.device_merkle import Schedule, chunk_roots, supported
from zkdv.jax.device_probes import DeviceProbes
from zkdv.merkle import LeafSpec, StateCommitment
from zkdv.probes import ProbeSet

__all__ = ["DeviceCommitter", "SnapshotPool", "TransferLog", "leaf_specs"]


def leaf_specs(paths: Sequence[str], leaves: Sequence[Any]) -> tuple[LeafSpec, ...]:
    """The specs the host path would record for these device leaves."""
    return tuple(
        LeafSpec(path, str(np.dtype(leaf.dtype).name), tuple(int(d) for d in leaf.shape))
        for path, leaf in zip(paths, leaves, strict=True)
    )


class TransferLog(transfers.TransferLog):
    """:class:`zkdv.transfers.TransferLog` with JAX's explicit, counted read."""

    def fetch(self, step: int, kind: str, value: Any) -> Any:
        """``jax.device_get(value)``, counted. An explicit read: allowed under a
        ``jax.transfer_guard_device_to_host("disallow")``, which forbids implicit ones."""
        host = jax.device_get(value)
        self.add(step, kind, sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)))
        return host


class DeviceCommitter:
    """Chunk roots and probes of one proof's states, computed on their device.

    Args:
        chunk_bytes: the run's Merkle chunk size.
        log: where reads back to the host are counted.
        schedule: layout of the hashing program; by backend when None.
    """

    def __init__(
        self, chunk_bytes: int, log: TransferLog, schedule: Schedule | None = None
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.schedule = schedule
        self.log = log
        self._probes: DeviceProbes | None = None
        self._zeros: dict[tuple[Any, ...], jax.Array] = {}

    @staticmethod
    def unsupported(paths: Sequence[str], leaves: Sequence[Any]) -> list[str]:
        """Paths of leaves whose dtype the device kernels cannot hash."""
        return [
            p
            for p, leaf in zip(paths, leaves, strict=True)
            if not all(supported(leaf.dtype, d.platform) for d in leaf.devices())
        ]

    def roots(self, leaves: Sequence[Any]) -> jax.Array:
        """Dispatch the chunk roots of a state (``(leaves, 8)`` uint32, on the device)."""
        return chunk_roots(leaves, self.chunk_bytes, schedule=self.schedule)

    def start_probes(self, probes: ProbeSet) -> None:
        if self._probes is None or self._probes.probes is not probes:
            self._probes = DeviceProbes(probes)

    def project(self, leaves: Sequence[Any]) -> jax.Array:
        """Dispatch the probes of a parameter tree (one float32 vector, on the device)."""
        assert self._probes is not None, "start_probes() before the first projection"
        return self._probes(leaves)

    def zeros(self, like: Any) -> jax.Array:
        """Zeros shaped as ``like`` (a parameter without a gradient), made once per shape:
        a fresh ``jnp.zeros_like`` per parameter and step is an eager dispatch each."""
        key = (tuple(like.shape), str(like.dtype), like.sharding)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = jnp.zeros_like(like)
        return zeros

    def commitment(self, step: int, specs: Sequence[LeafSpec], roots: jax.Array) -> StateCommitment:
        """Read a state's chunk roots (32 bytes per leaf) and finish its root on the host."""
        host = self.log.fetch(step, "roots", roots)
        return state_commitment(specs, roots_to_bytes(np.asarray(host).reshape(-1, 8)))

    def probe_values(self, step: int, flat: jax.Array) -> list[np.ndarray]:
        assert self._probes is not None
        return self._probes.split(np.asarray(self.log.fetch(step, "probes", flat)))

    def element(self, step: int, leaves: Sequence[Any], flat_index: int) -> float:
        """One coordinate of a state, by its flat index over all leaves: one value read.

        Cast as the attested program casts the replayed one (``_steps._select``).
        """
        cast = selection_cast(leaves)
        offset = 0
        for leaf in leaves:
            size = int(np.prod(leaf.shape, dtype=np.int64))
            if flat_index < offset + size:
                position = np.unravel_index(flat_index - offset, leaf.shape)
                value = leaf[tuple(int(i) for i in position)]
                return float(cast(np.asarray(self.log.fetch(step, "values", value))))
            offset += size
        return 0.0


# Where a device offers host memory (JAX memory kinds), in order of preference.
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def host_sharding(sharding: Any) -> Any | None:
    """``sharding`` moved to host memory (pinned when offered), or None if it has none."""
    device: Any = next(iter(sharding.device_set))
    kinds = {memory.kind for memory in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return sharding.with_memory_kind(kind)
    return None


def host_shardings(leaves: Sequence[Any]) -> list[Any] | None:
    """Each leaf's sharding in host memory (pinned when offered), or None if one has none."""
    out = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        target = None if sharding is None else host_sharding(sharding)
        if target is None:
            return None
        out.append(target)
    return out


@dataclass
class _Job:
    program: Any
    source: list[Any]
    target: list[Any]
    dispatched: threading.Event = field(default_factory=threading.Event)
    result: list[Any] | None = None
    error: BaseException | None = None


class SnapshotPool:
    """Reusable host buffers for replay snapshots and the program that fills them.

    Args:
        leaves: the state's leaves (their shapes, dtypes and shardings fix the pool).
        shardings: the leaves' host-memory shardings (:func:`host_shardings`).
        slots: buffers allocated up front; at most two snapshots are normally alive
            (the latest and the one a pending check still replays from), and the pool
            grows by one slot, counted in :attr:`allocated`, if a third is needed.
    """

    def __init__(self, leaves: Sequence[Any], shardings: Sequence[Any], *, slots: int = 2):
        specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]  # type: ignore[no-untyped-call]
        host = list(shardings)

        def empty() -> list[Any]:
            return [jnp.zeros(s.shape, s.dtype) for s in specs]

        def copy(source: list[Any], target: list[Any]) -> list[Any]:
            # The target buffers are donated and unused: XLA writes the copy into them.
            del target
            return list(source)

        self._allocate: Callable[[], list[Any]] = jax.jit(empty, out_shardings=host)
        self._copy = jax.jit(copy, donate_argnums=(1,), out_shardings=host, keep_unused=True)
        # Compiled now, before training; a later layout change recompiles, like jax.jit.
        self._copy.lower(list(leaves), self._allocate()).compile()
        self._lock = threading.Lock()
        self._free = [self._allocate() for _ in range(slots)]
        jax.block_until_ready(self._free)  # type: ignore[no-untyped-call]
        self.allocated = slots
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="zkdv-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = list(self._copy(job.source, job.target))
            except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
                job.error = error
            finally:
                job.dispatched.set()

    def copy(self, leaves: Sequence[Any]) -> list[Any]:
        """Launch a copy of ``leaves`` into a free slot; returns the host arrays.

        Returns once JAX has registered the read of ``leaves`` (they may be donated
        right after); the copy itself completes asynchronously.
        """
        with self._lock:
            if self._free:
                target = self._free.pop()
            else:
                target = self._allocate()
                self.allocated += 1
        job = _Job(self._copy, list(leaves), target)
        self._jobs.put(job)
        job.dispatched.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def release(self, arrays: Sequence[Any]) -> None:
        """Give a snapshot's host arrays back once nothing reads them any more."""
        with self._lock:
            self._free.append(list(arrays))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        with self._lock:
            self._free.clear()
