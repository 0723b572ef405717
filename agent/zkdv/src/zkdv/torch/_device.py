"""The Torch frontend's device path: commitments computed where the state lives.

On the host path every step's post-update state is read to host memory and hashed
there: on a GPU that is a full device-to-host copy of the state per step. On the device
path (``ZKDVConfig(commitments="device")``, or ``"auto"`` with the parameters on CUDA in
a single process) the training thread dispatches, right after the optimizer step and
on its own stream, the Merkle chunk root of every state leaf
(:func:`zkdv.torch._device_merkle.chunk_roots`) and the probes
(:class:`zkdv.torch._device_probes.DeviceProbes`); the commit stage reads back 32 bytes
per leaf and the probe values, and finishes the tensor digests and state roots on the
host. The full state reaches the host only at snapshot steps, through the
:class:`~zkdv.torch._checkpoint.ReplayCheckpoint`'s reused pinned buffers. The bytes
written are the host path's, bit for bit (both use the same exact probe arithmetic).

Leaves that live on the host anyway (``torch.optim``'s non-capturable ``step``
counters, Python numbers) are hashed on the host, read from where they are.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zkdv.device_merkle import state_commitment
from zkdv.merkle import StateCommitment, chunk_hashes, merkle_root
from zkdv.probes import ProbeSet
from zkdv.torch._arrays import host_array
from zkdv.torch._device_merkle import chunk_roots, leaf_spec, roots_bytes
from zkdv.torch._device_probes import DeviceProbes
from zkdv.transfers import TransferLog

__all__ = ["DeviceCommitter", "PendingProbes", "PendingRoots"]


@dataclass
class PendingRoots:
    """Chunk roots dispatched for one state tree, not read back yet."""

    paths: list[str]
    tensors: list[torch.Tensor]
    on_device: list[int]
    roots: torch.Tensor | None
    done: Any


@dataclass
class PendingProbes:
    """The pre-update, post-update and delta probes of one step, on the device, and the
    gradient's when the step commits it."""

    pre: torch.Tensor
    post: torch.Tensor
    delta: torch.Tensor
    done: Any
    grad: torch.Tensor | None = None


def _event(device: torch.device) -> Any:
    """A point in the training stream the commit thread waits for before reading."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(done: Any) -> None:
    if done is not None:
        done.synchronize()


class DeviceCommitter:
    """Commitments of one proof's states on their device.

    Args:
        device: where the parameters live.
        chunk_bytes: the run's Merkle chunk size.
        probes: the run's probe set.
        log: where every read back to the host is counted.
        compiled: run the hashing through ``torch.compile`` (Triton kernels on CUDA);
            by default on CUDA only. Eager tensor code launches one kernel per
            operation; if compiling fails, the hashing falls back to it with a warning.
    """

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int,
        probes: ProbeSet,
        log: TransferLog,
        *,
        compiled: bool | None = None,
    ) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.probes = DeviceProbes(probes, device)
        self.log = log
        self.compiled = device.type == "cuda" if compiled is None else compiled

    # --- dispatch (training thread) ------------------------------------------------------
    def select(self, parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the rows the probes read (float32, on the device)."""
        return self.probes.select(parameters)

    def roots(self, leaves: Sequence[tuple[str, torch.Tensor]]) -> PendingRoots:
        """Dispatch the chunk roots of one state tree's leaves on the device."""
        paths = [path for path, _ in leaves]
        tensors = [tensor.detach() for _, tensor in leaves]
        on_device = [i for i, t in enumerate(tensors) if t.device == self.device]
        roots = None
        if on_device:
            roots = self._chunk_roots([tensors[i] for i in on_device])
        return PendingRoots(paths, tensors, on_device, roots, _event(self.device))

    def _chunk_roots(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.compiled:
            try:
                return chunk_roots(tensors, self.chunk_bytes, compiled=True)
            except Exception as error:  # noqa: BLE001 - any compiler failure: eager code
                warnings.warn(
                    f"ZKDV could not compile the device hashing ({type(error).__name__}: "
                    f"{error}); it runs as eager tensor code, one kernel per operation",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.compiled = False
        return chunk_roots(tensors, self.chunk_bytes, compiled=False)

    def probe(
        self,
        pre_rows: Sequence[torch.Tensor],
        post: Sequence[torch.Tensor],
        gradients: Sequence[torch.Tensor | None] | None = None,
    ) -> PendingProbes:
        """Dispatch the step's probes: of the pre rows, the post rows and their difference,
        and of the gradient (zeros for a parameter without one) when it is committed."""
        post_rows = self.probes.select(post)
        with torch.no_grad():
            delta = [after - before for after, before in zip(post_rows, pre_rows, strict=True)]
            grad = None
            if gradients is not None:
                grad = self.probes.project_rows(self.probes.select_present(gradients))
        return PendingProbes(
            self.probes.project_rows(pre_rows),
            self.probes.project_rows(post_rows),
            self.probes.project_rows(delta),
            _event(self.device),
            grad,
        )

    # --- read back (commit thread) -------------------------------------------------------
    def commitment(self, step: int, pending: PendingRoots) -> StateCommitment:
        """The state commitment, from 32 bytes per device leaf (counted as ``roots``)."""
        _wait(pending.done)
        digests: list[bytes] = [b""] * len(pending.tensors)
        if pending.roots is not None:
            for index, digest in zip(pending.on_device, roots_bytes(pending.roots), strict=True):
                digests[index] = digest
            self.log.add(step, "roots", 32 * len(pending.on_device))
        for index, tensor in enumerate(pending.tensors):
            if index in pending.on_device:
                continue
            # A host leaf (a step counter): hashed where it is.
            digests[index] = merkle_root(chunk_hashes(host_array(tensor), self.chunk_bytes))
        specs = [
            leaf_spec(path, tensor)
            for path, tensor in zip(pending.paths, pending.tensors, strict=True)
        ]
        return state_commitment(specs, digests)

    def read_probes(self, step: int, pending: PendingProbes) -> tuple[list[np.ndarray], ...]:
        """The three (four with the gradient's) probes per parameter leaf (counted as
        ``probes``)."""
        _wait(pending.done)
        parts = []
        vectors = [pending.pre, pending.post, pending.delta]
        if pending.grad is not None:
            vectors.append(pending.grad)
        for vector in vectors:
            host = vector.cpu().numpy()
            self.log.add(step, "probes", host.nbytes)
            parts.append(self.probes.split(host))
        return tuple(parts)
