"""One eager Torch training transaction submitted through the ZKDV pipeline.

``with proof.transaction(batch=...)`` brackets one ordinary eager step. On entry it
is admitted by flow control, packs (copies) the batch into the committed uint32 rows
and clones the module's mutable buffers (BatchNorm running statistics included)
before the forward can change them; the first transaction also seals the attested
program. The prepared optimizer's ``step()`` waits at the mutation barrier (the
previous step's commitment may still be hashing the live state), copies the rows of
the pre-update parameters that the probes read (every ``replay_snapshot_interval``
steps, the full pre-state into a replay snapshot instead), then runs the native
``torch.optim`` step. On exit
the post-update buffers are cloned and the step is submitted; its commitment reads the
live parameters and optimizer state on the commit thread while the next step's
forward and backward run. Under FSDP2 it reads instead the full parameters and optimizer
state that every rank all-gathered on the training thread at the step's end.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from zkdv import overlap as overlap_policy
from zkdv.driver import Leaves, ReplayOutcome, Submission
from zkdv.probes import ProbeSet
from zkdv.sampling import Challenge
from zkdv.torch._arrays import host_array
from zkdv.torch._computed import ComputedHost, computed_leaves
from zkdv.torch._pipeline import FlatIndex, element

if TYPE_CHECKING:
    from zkdv.torch._arrays import HostViews
    from zkdv.torch._device import DeviceCommitter
    from zkdv.torch.optimizers.bridge import OptimizerBridge
    from zkdv.transfers import TransferLog

__all__ = ["NESTED", "EagerTransaction", "current_transaction", "host_array"]

NESTED = "nested ZKDV Torch transactions are unsupported"


class EagerHost(ComputedHost, Protocol):
    """What a transaction and its step need from the driver (:class:`zkdv.torch.ZKDV`):
    beside what the computed values read, the transfer log, the device committer and
    host views, the optimizer's bridge, and the hooks that open, close and abort a
    transaction, replay a check and retire a step. Stated here so that this module does
    not import the driver."""

    @property
    def transfers(self) -> TransferLog: ...

    @property
    def _layout(self) -> Layout: ...

    @property
    def _device_committer(self) -> DeviceCommitter | None: ...

    @property
    def _host_views(self) -> HostViews: ...

    def _bridge(self) -> OptimizerBridge: ...

    def _open_prepared_transaction(self, transaction: EagerTransaction) -> Any: ...

    def _close_prepared_transaction(self, transaction: EagerTransaction) -> None: ...

    def _abort_prepared_transaction(self, transaction: EagerTransaction) -> None: ...

    def _replay(self, challenge: Challenge, committed_post: float) -> ReplayOutcome: ...

    def _retired(self, index: int) -> None: ...


_CURRENT: ContextVar[EagerTransaction | None] = ContextVar("zkdv_torch_transaction", default=None)


def current_transaction() -> EagerTransaction | None:
    """The open eager transaction of this context, or None."""
    return _CURRENT.get()


class EagerTransaction:
    """Keep a proof transaction open from eager forward through optimizer step.

    Created by :meth:`zkdv.torch.ZKDV.transaction`; use it as a context manager.

    Raises:
        RuntimeError: another transaction is already open in this context.
    """

    def __init__(
        self,
        proof: EagerHost,
        batch: Any,
        overlap: overlap_policy.Policy = overlap_policy.UNCHECKED,
    ) -> None:
        if _CURRENT.get() is not None:
            raise RuntimeError(NESTED)
        self.proof = proof
        self.batch = batch
        self.overlap = overlap_policy.Policy(overlap)
        self.buffers_before = tuple(
            buffer.clone() for buffer in proof._require_prepared_model().buffers
        )
        self.stepped = False
        self.dropped = False
        self.admission: Any = None
        self.words: np.ndarray | None = None
        self.index = -1
        self.pre_rows: list[torch.Tensor] | None = None
        self.snapshot: Any = None
        #: The dynamic optimizer options ``optimizer.step()`` used (the record's ``hp``).
        self.hyperparameters: list[dict[str, Any]] | None = None
        #: Copies of the gradients the update read, per parameter (None: not trained);
        #: None when the run does not commit them.
        self.gradients: list[torch.Tensor | None] | None = None
        #: Seeds the default generators for the step's random operators, if it has any.
        self.generators: Any = None
        self.pending = proof._open_prepared_transaction(self)
        self._token: Token[EagerTransaction | None] | None = _CURRENT.set(self)
        self._complete = False

    def __enter__(self) -> EagerTransaction:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        if self.generators is not None:
            self.generators.__exit__(kind, error, traceback)
            self.generators = None
        if self._complete:
            return
        self._complete = True
        if error is not None:
            self.proof._abort_prepared_transaction(self)
            return
        self.proof._close_prepared_transaction(self)


class TorchStep(Submission):
    """One eager step as the driver's pipeline sees it."""

    def __init__(
        self,
        proof: EagerHost,
        transaction: EagerTransaction,
        *,
        parameters: tuple[torch.Tensor, ...],
        states: list[dict[str, Any]] | None = None,
        post_buffers: list[torch.Tensor],
        tokens: int,
        flops: float | None,
        device: Any = None,
    ) -> None:
        self.proof = proof
        self.index = transaction.index
        self.policy = transaction.overlap
        self.tokens = tokens
        self.flops = flops
        self.hyperparameters = transaction.hyperparameters
        self.gradients = transaction.gradients
        assert transaction.words is not None
        self.words = transaction.words
        # Pre-update values: the probed rows only, or the whole snapshot on snapshot steps.
        self.pre_rows = transaction.pre_rows
        self.parameters = parameters
        # The live state, or under FSDP2 the full state gathered at the step's end.
        self.states = proof._bridge().live_states() if states is None else states
        self.post_buffers = post_buffers
        self.buffers_before = transaction.buffers_before
        self.replay_snapshot = transaction.snapshot
        # Kept past retirement: the snapshot stage may still be writing its file.
        self._snapshot_slot = transaction.snapshot
        self._state_leaves: list[torch.Tensor] | None = None
        self._host_parameters: list[np.ndarray] | None = None
        self._committed_post = 0.0
        self._layout = proof._layout
        #: On the device path: ``(roots of each tree, probes, roots of the computed
        #: values)`` dispatched on the device, read back by the commit stage
        #: (:mod:`zkdv.torch._device`); None on the host path.
        self.device = device
        if transaction.snapshot is not None:
            snap = transaction.snapshot
            self.snapshot = self._leaves(snap.parameters, snap.states, snap.buffers)

    def _leaves(
        self,
        parameters: Any,
        states: Any,
        buffers: Any,
    ) -> tuple[Leaves, Leaves, Leaves]:
        state_leaves = self.proof._bridge().leaves(states, parameters)
        return self._named(
            [host_array(t) for t in parameters],
            [host_array(t) for t in state_leaves],
            [host_array(t) for t in buffers],
        )

    def _named(
        self, parameters: list[np.ndarray], states: list[np.ndarray], buffers: list[np.ndarray]
    ) -> tuple[Leaves, Leaves, Leaves]:
        """Host arrays of the three trees with their committed leaf names."""
        layout = self._layout
        return (
            list(zip(layout.parameter_names, parameters, strict=True)),
            list(zip(layout.state_paths, states, strict=True)),
            list(zip(layout.buffer_names, buffers, strict=True)),
        )

    def initial_state(self) -> tuple[Leaves, Leaves, Leaves]:
        snap = self.replay_snapshot
        assert snap is not None, "the first step always takes a replay snapshot"
        return self._leaves(snap.parameters, snap.states, snap.buffers)

    def batch(self) -> np.ndarray:
        return self.words

    def post_state(self) -> tuple[Any, Any, Any]:
        self._state_leaves = self.proof._bridge().leaves(self.states, self.parameters)
        committer = self.proof._device_committer
        if self.device is not None and committer is not None:
            (params, opt_state, buffers), _, _ = self.device
            return (
                committer.commitment(self.index, params),
                committer.commitment(self.index, opt_state),
                committer.commitment(self.index, buffers),
            )
        # The live parameters and state, updated in place: their views are kept.
        views = self.proof._host_views
        self._host_parameters = views.arrays("parameters", self.parameters)
        leaves = self._named(
            self._host_parameters,
            views.arrays("states", self._state_leaves),
            [host_array(t) for t in self.post_buffers],
        )
        self.proof.transfers.add(
            self.index, "state", sum(array.nbytes for tree in leaves for _, array in tree)
        )
        return leaves

    def computed(self) -> tuple[Any, Leaves | None] | None:
        """The gradients the update read, then the state the forward pass wrote.

        Gradient leaves for the trained parameters, every buffer after the step
        (BatchNorm's running statistics), and a GradScaler's scale and growth tracker
        as the step left them (:mod:`zkdv.gradients`).
        """
        gradients = self.gradients
        if gradients is None:
            return None
        tensors = computed_leaves(self.proof, gradients, self.post_buffers)
        committer = self.proof._device_committer
        keep = self.proof.runtime.keep_gradient_files
        if self.device is not None and committer is not None:
            _, _, pending = self.device
            files = None
            if keep:
                # The file the platform's replay reads: the one per-step read of
                # O(parameters) on the device path (docs/torch.md, "Device-side commitments").
                files = [(name, host_array(t)) for name, t in tensors]
                self.proof.transfers.add(
                    self.index, "gradient", sum(array.nbytes for _, array in files)
                )
            return committer.commitment(self.index, pending), files
        leaves = [(name, host_array(tensor)) for name, tensor in tensors]
        self.proof.transfers.add(self.index, "gradient", sum(array.nbytes for _, array in leaves))
        if not keep:
            return leaves, None
        # The file is written after the commit stage releases the live state: it keeps
        # the step's own copies (gradients, buffers) and copies what is live (a
        # GradScaler's scalars), which the next step may change.
        owned = {id(t) for t in (*gradients, *self.post_buffers) if t is not None}
        files = [
            (name, array if id(tensor) in owned else array.copy())
            for (name, array), (_, tensor) in zip(leaves, tensors, strict=True)
        ]
        return leaves, files

    def probes(self, probes: ProbeSet) -> tuple[list[np.ndarray], ...] | None:
        committer = self.proof._device_committer
        if self.device is not None and committer is not None:
            _, pending, _ = self.device
            return committer.read_probes(self.index, pending)
        snapshot = self.replay_snapshot
        before, after = [], []
        parameters = self._host_parameters
        assert parameters is not None, "the commit stage reads the post-state first"
        for leaf, array in enumerate(parameters):
            if self.pre_rows is not None:
                before.append(host_array(self.pre_rows[leaf]).astype(np.float32, copy=False))
            else:
                assert snapshot is not None
                before.append(probes.select(leaf, host_array(snapshot.parameters[leaf])))
            after.append(probes.select(leaf, array))
        grads = None
        if self.gradients is not None:
            grads = [
                None if gradient is None else probes.select(leaf, host_array(gradient))
                for leaf, gradient in enumerate(self.gradients)
            ]
        # The exact probe arithmetic (zkdv.probes): the device path writes these bits.
        return probes.project_steps(before, after, grads)

    def capture(self, challenge: Challenge) -> tuple[float, float]:
        # The committed post-update value; the replay forms the committed update against
        # its own pre-update value (ReplayOutcome.committed_delta), so no step copies
        # every parameter before the optimizer overwrites it.
        assert self._state_leaves is not None
        self._committed_post = element(
            self.parameters, self._layout.parameter_index, challenge.param_index
        )
        state = element(self._state_leaves, self._layout.state_index, challenge.state_index)
        self.proof.transfers.add(self.index, "values", 16)
        return self._committed_post, state

    def release_views(self) -> None:
        self.pre_rows = None
        self.gradients = None
        self.parameters = ()
        self.states = []
        self._state_leaves = None
        self._host_parameters = None
        self.device = None

    def snapshot_written(self) -> None:
        if self._snapshot_slot is not None:
            self._snapshot_slot.written.set()
            self._snapshot_slot = None

    def replay(self, challenge: Challenge) -> ReplayOutcome:
        return self.proof._replay(challenge, self._committed_post)

    def retire(self) -> None:
        self.proof._retired(self.index)
        self.replay_snapshot = None
        self.post_buffers = []
        self.buffers_before = ()


class Layout:
    """The committed leaf names and flat indices of one prepared model and optimizer."""

    def __init__(
        self,
        parameter_names: tuple[str, ...],
        state_paths: list[str],
        buffer_names: tuple[str, ...],
        parameter_sizes: list[int],
        state_sizes: list[int],
    ) -> None:
        self.parameter_names = parameter_names
        self.state_paths = state_paths
        self.buffer_names = buffer_names
        self.parameter_index = FlatIndex.of(parameter_sizes)
        self.state_index = FlatIndex.of(state_sizes)
