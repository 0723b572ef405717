"""One ``proof.jit`` invocation as the shared pipeline sees it.

:class:`_Step` implements :class:`~zkdv.driver.protocol.Submission` over a host
commitment path (state read to the host on the commit thread); :class:`_DeviceStep`
over the device path (chunk roots and probes dispatched on the device, only digests
read back). Both read and write the run's bookkeeping through their proof (snapshots,
batches kept for replays, the transfer log).

In a run that commits its gradients the step also hands over its computed values (the
gradient of each trained parameter, then the carried state; :mod:`zkdv.gradients`) and
a fourth probe row, the gradient's; its delta row is the realized change
``float32(after) - float32(before)``, which is what the platform's replay projects.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from zkdv.driver import Leaves, ReplayOutcome, Submission
from zkdv.driver.protocol import State
from zkdv.jax._device import DeviceCommitter
from zkdv.jax._optimizer import UpdateSpec
from zkdv.jax._program import _Program
from zkdv.jax._tree import selection_cast
from zkdv.merkle import StateCommitment
from zkdv.overlap import Policy
from zkdv.probes import ProbeSet
from zkdv.sampling import Challenge

if TYPE_CHECKING:
    from zkdv.config import ZKDVConfig
    from zkdv.driver import Runtime
    from zkdv.jax._device import TransferLog

__all__ = ["_DeviceStep", "_Step"]


def _select(views: Sequence[np.ndarray], flat_index: int) -> float:
    """One committed coordinate, read as the attested program reads the replayed one.

    ``zkdv.jax._tree.index`` casts the selected element to float32 (float64 if a leaf
    is float64), so an integer state above 2**24 (a count, an RNG key's data) is rounded
    the same way on both sides of the comparison.
    """
    cast = selection_cast(views)
    offset = 0
    for view in views:
        if flat_index < offset + view.size:
            return float(cast(view.reshape(-1)[flat_index - offset]))
        offset += view.size
    return 0.0


class StepHost(Protocol):
    """What a step needs from the driver that dispatched it (:class:`zkdv.jax.ZKDV`).

    The shared :class:`~zkdv.driver.Runtime`, the run's configuration, and the JAX
    driver's own bookkeeping: its transfer log and device committer, the previous
    step's post-update probes, its snapshot store, and the hooks a step calls as the
    pipeline moves it along (snapshot written, batch kept, continuity checked, check
    expected, committed, replayed, retired). Stated here so that this module does not import the driver.
    """

    config: ZKDVConfig
    _log: TransferLog
    _device: DeviceCommitter | None
    _last_post_probe: list[np.ndarray] | None
    _post_rows: list[np.ndarray] | None
    # Snapshots of scanned steps (zkdv.jax._scan), by step, written under the lock.
    _store_lock: threading.Lock
    _snapshots: dict[int, tuple[list[Any], list[Any]]]

    @property
    def runtime(self) -> Runtime: ...

    def _snapshot_done(self, index: int) -> None: ...

    def _keep_batch(self, index: int, batch: np.ndarray) -> None: ...

    def _verify_continuity(
        self, index: int, host_pre: tuple[list[np.ndarray], list[np.ndarray]]
    ) -> None: ...

    def _check_continuity(self, index: int, params: bytes, opt: bytes) -> None: ...

    def _expect_check(self, step: int) -> None: ...

    def _committed(self, index: int) -> None: ...

    def _retired(self, index: int) -> None: ...

    def _replay(
        self, challenge: Challenge, committed_post: float | None = None
    ) -> ReplayOutcome: ...


class _Step(Submission):
    """One dispatched proof.jit invocation, as the driver pipeline sees it."""

    def __init__(
        self,
        proof: StepHost,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        host_pre: tuple[list[np.ndarray], list[np.ndarray]] | None,
        snapshot: tuple[list[Any], list[Any]] | None,
    ) -> None:
        traced = program.traced
        nd = traced.delta_leaves
        nparams = len(traced.param_positions)
        self.proof = proof
        self.program = program
        self.index = index
        self.policy = policy
        self.flops = program.flops
        self.tokens = program.tokens(proof.config.token_unit)
        # None where the apply program wrote over the pre-update parameters
        # (``_Program.host_deltas``): the delta probes come from the probed rows.
        self._deltas: list[Any] | None = None if program.host_deltas else list(outputs[:nd])
        self._committed_post: float | None = None
        self._params: list[Any] | None = list(outputs[nd : nd + nparams])
        self._opt: list[Any] | None = list(outputs[nd + nparams : traced.schema.hidden_leaves])
        self._packed: Any = outputs[traced.schema.hidden_leaves]
        start = traced.schema.hidden_leaves + 1
        self._computed: list[Any] | None = (
            list(outputs[start : start + len(traced.computed_names)]) if traced.commits else None
        )
        self._gradients: list[np.ndarray | None] | None = None
        self._batch: np.ndarray | None = None
        self._host_pre = host_pre
        self._snapshot_source = snapshot
        self._views: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None] | None = (
            None
        )

    # The driver reads ``snapshot`` on the commit thread and then clears it; reading
    # host views here, not on the training thread, keeps the training thread unblocked.
    @property
    def snapshot(self) -> tuple[Leaves, Leaves, Leaves] | None:
        source = self._snapshot_source
        if source is None:
            return None
        traced = self.program.traced
        return (
            list(zip(traced.param_paths, [np.asarray(a) for a in source[0]], strict=True)),
            list(zip(traced.opt_paths, [np.asarray(a) for a in source[1]], strict=True)),
            [],
        )

    @snapshot.setter
    def snapshot(self, value: Any) -> None:
        if (
            value is None
            and self._snapshot_source is not None
            and not self.proof.runtime.keep_files
        ):
            self.proof._snapshot_done(self.index)
        self._snapshot_source = None if value is None else self._snapshot_source

    def snapshot_written(self) -> None:
        self.proof._snapshot_done(self.index)

    def initial_state(self) -> tuple[State, State, State]:
        assert self._host_pre is not None
        traced = self.program.traced
        params, opt = self._host_pre
        return (
            list(zip(traced.param_paths, params, strict=True)),
            list(zip(traced.opt_paths, opt, strict=True)),
            [],
        )

    def batch(self) -> np.ndarray:
        if self._batch is None:
            self._batch = np.asarray(self.proof._log.fetch(self.index, "batch", self._packed))
            self._packed = None
            self.proof._keep_batch(self.index, self._batch)
            if self._host_pre is not None and self.index > 0:
                self.proof._verify_continuity(self.index, self._host_pre)
        return self._batch

    def computed(self) -> tuple[State, Leaves | None] | None:
        """The step's computed values: each trained parameter's gradient, then the
        state the step wrote besides the optimizer (``zkdv.jax._optimizer``)."""
        if self._computed is None:
            return None
        traced = self.program.traced
        assert traced.update is not None
        read = self._read_computed(traced.update, traced.computed_names, self._computed)
        self._computed = None
        return read

    def _read_computed(
        self, spec: UpdateSpec, names: Sequence[str], arrays: Sequence[Any]
    ) -> tuple[State, Leaves | None]:
        """The computed values ``arrays`` read to the host (the transfer log's
        ``gradient``) as named leaves, and those to write as files; each trained
        parameter's gradient (they come first, in ``spec.grads`` order) is kept for the
        gradient probes."""
        host = [np.asarray(a) for a in self.proof._log.fetch(self.index, "gradient", arrays)]
        gradients: list[np.ndarray | None] = [None] * len(self.program.traced.param_positions)
        for position, array in zip(spec.grads, host, strict=False):
            gradients[position] = array
        self._gradients = gradients
        leaves = list(zip(names, host, strict=True))
        return leaves, leaves if self.proof.runtime.keep_gradient_files else None

    def post_state(self) -> tuple[State, State, State]:
        assert self._params is not None and self._opt is not None
        traced = self.program.traced
        params = [np.asarray(leaf) for leaf in self._params]
        opt = [np.asarray(leaf) for leaf in self._opt]
        deltas = None if self._deltas is None else [np.asarray(leaf) for leaf in self._deltas]
        self._views = (params, opt, deltas)
        self.proof._log.add(
            self.index, "state", sum(a.nbytes for tree in self._views if tree for a in tree)
        )
        return (
            list(zip(traced.param_paths, params, strict=True)),
            list(zip(traced.opt_paths, opt, strict=True)),
            [],
        )

    def probes(self, probes: ProbeSet) -> tuple[list[np.ndarray], ...]:
        assert self._views is not None
        params, _, deltas = self._views
        gradients = self._gradients
        if deltas is None:
            return self._row_probes(probes, params, gradients)
        jobs = []
        for leaf, (param, change) in enumerate(zip(params, deltas, strict=True)):
            rows = [probes.select(leaf, param), probes.select(leaf, change)]
            gradient = None if gradients is None else gradients[leaf]
            if gradient is not None:
                rows.append(probes.select(leaf, gradient))
            jobs.append((leaf, rows))
        # Every leaf's post-update, delta (and gradient) rows in few exact products.
        projected = probes.project_many(jobs)
        post = [rows[0] for rows in projected]
        delta = [rows[1] for rows in projected]
        if self._host_pre is not None:
            pre = probes.project_all(self._host_pre[0])
        else:
            # The inputs were the previous step's outputs (checked by identity), so
            # their probe is the previous post-update probe.
            previous = self.proof._last_post_probe
            assert previous is not None
            pre = previous
        self.proof._last_post_probe = post
        if gradients is None:
            return pre, post, delta
        # A parameter without a gradient has a zero gradient probe (zkdv.probes).
        grad = [rows[2] if len(rows) > 2 else np.zeros_like(rows[0]) for rows in projected]
        return pre, post, delta, grad

    def _row_probes(
        self,
        probes: ProbeSet,
        params: list[np.ndarray],
        gradients: list[np.ndarray | None] | None,
    ) -> tuple[list[np.ndarray], ...]:
        """The probes of a step whose apply program wrote over its pre-update parameters.

        The delta rows are the probed rows' ``post - pre`` in float32, subtracted on the
        host as the platform's replay subtracts them (``Artifact.apply``). The pre-update
        rows are the previous step's post-update rows, kept by its commitment, or those
        of the state copied before the step (the first step, a discontinuity).
        """
        if self._host_pre is not None:
            before = [probes.select(leaf, array) for leaf, array in enumerate(self._host_pre[0])]
        else:
            assert self.proof._post_rows is not None
            before = self.proof._post_rows
        after = [probes.select(leaf, array) for leaf, array in enumerate(params)]
        grads = None
        if gradients is not None:
            grads = [
                None if gradient is None else probes.select(leaf, gradient)
                for leaf, gradient in enumerate(gradients)
            ]
        projected = probes.project_steps(before, after, grads)
        # The next step's apply program writes over the parameters these rows may view.
        self.proof._post_rows = [rows if rows.flags.owndata else rows.copy() for rows in after]
        return projected

    def capture(self, challenge: Challenge) -> tuple[float, float]:
        assert self._views is not None
        params, opt, deltas = self._views
        self.proof._expect_check(challenge.step)
        state = _select(opt, challenge.state_index)
        if deltas is None:
            # The pre-update value is overwritten: the replay forms the committed update
            # against its own (ReplayOutcome.committed_delta).
            self._committed_post = _select(params, challenge.param_index)
            return self._committed_post, state
        return _select(deltas, challenge.param_index), state

    def release_views(self) -> None:
        self._views = None
        self._deltas = self._params = self._opt = None
        self._host_pre = None
        self._computed = self._gradients = None
        self.proof._committed(self.index)

    def replay(self, challenge: Challenge) -> ReplayOutcome:
        return self.proof._replay(challenge, self._committed_post)

    def retire(self) -> None:
        self.release_views()
        self._snapshot_source = None
        self.proof._retired(self.index)


class _DeviceStep(_Step):
    """A step whose commitments were dispatched on the device (``commitments='device'``).

    The training thread dispatched the chunk roots and probes of the post-update state
    (and, when the inputs do not continue the previous step, of the pre-update state)
    right after the step; the commit stage reads back only those digests and probes,
    the batch, and the two challenged values. The state itself reaches the host only
    through replay snapshots (:class:`~zkdv.jax._device.SnapshotPool`).
    """

    def __init__(
        self,
        proof: StepHost,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        snapshot: tuple[list[Any], list[Any]] | None,
        pre: tuple[Any, Any, Any, tuple[Any, Any]] | None,
        post: tuple[Any, Any, Any, Any, tuple[Any, Any]],
        computed: tuple[Any, Any, Any] | None = None,
    ) -> None:
        super().__init__(proof, program, index, policy, outputs, None, snapshot)
        self._pre = pre
        self._post: tuple[Any, Any, Any, Any, tuple[Any, Any]] | None = post
        #: The computed values' chunk roots, their specs and the gradient's probes
        #: (dispatched on the device), in a run that commits gradients.
        self._device_computed = computed

    @property
    def snapshot(self) -> tuple[Leaves, Leaves, Leaves] | None:
        source = self._snapshot_source
        if source is None:
            return None
        traced = self.program.traced
        # Host-memory arrays: an explicit read, and no device transfer (counted when
        # the copy was launched).
        params, opt = jax.device_get((source[0], source[1]))
        return (
            list(zip(traced.param_paths, [np.asarray(a) for a in params], strict=True)),
            list(zip(traced.opt_paths, [np.asarray(a) for a in opt], strict=True)),
            [],
        )

    @snapshot.setter
    def snapshot(self, value: Any) -> None:
        _Step.snapshot.fset(self, value)  # type: ignore[attr-defined]

    def _device(self) -> DeviceCommitter:
        device = self.proof._device
        assert device is not None
        return device

    def initial_state(self) -> tuple[StateCommitment, StateCommitment, Leaves]:
        assert self._pre is not None
        params, opt, _, (param_specs, opt_specs) = self._pre
        device = self._device()
        return (
            device.commitment(self.index, param_specs, params),
            device.commitment(self.index, opt_specs, opt),
            [],
        )

    def batch(self) -> np.ndarray:
        # The host path's fetch, then this path's continuity check, once: one fetch for
        # both paths, so what replaces it (zkdv.jax.forgery) changes both alike.
        first = self._batch is None
        batch = super().batch()
        if first and self._pre is not None and self.index > 0:
            params, opt, _ = self.initial_state()
            self.proof._check_continuity(self.index, params.root, opt.root)
        return batch

    def computed(self) -> tuple[State, Leaves | None] | None:
        """The computed values' commitment, hashed on the device; their bytes are read
        only to keep ``files/grad-<step>.bin`` for the platform (``ZKDVConfig.
        gradient_files``: not on a TPU by default)."""
        pending = self._device_computed
        if pending is None:
            return None
        roots, specs, _ = pending
        values = self._computed
        assert values is not None
        commitment = self._device().commitment(self.index, specs, roots)
        files = None
        if self.proof.runtime.keep_gradient_files:
            host = [np.asarray(a) for a in self.proof._log.fetch(self.index, "gradient", values)]
            files = list(zip(self.program.traced.computed_names, host, strict=True))
        self._computed = None
        return commitment, files

    def post_state(self) -> tuple[StateCommitment, StateCommitment, Leaves]:
        assert self._post is not None
        params, opt, _, _, (param_specs, opt_specs) = self._post
        device = self._device()
        return (
            device.commitment(self.index, param_specs, params),
            device.commitment(self.index, opt_specs, opt),
            [],
        )

    def probes(self, probes: ProbeSet) -> tuple[list[np.ndarray], ...]:
        assert self._post is not None
        device = self._device()
        post = device.probe_values(self.index, self._post[2])
        delta = device.probe_values(self.index, self._post[3])
        if self._pre is not None:
            pre = device.probe_values(self.index, self._pre[2])
        else:
            previous = self.proof._last_post_probe
            assert previous is not None
            pre = previous
        self.proof._last_post_probe = post
        if self._device_computed is None:
            return pre, post, delta
        return pre, post, delta, device.probe_values(self.index, self._device_computed[2])

    def capture(self, challenge: Challenge) -> tuple[float, float]:
        assert self._deltas is not None and self._opt is not None
        self.proof._expect_check(challenge.step)
        device = self._device()
        return (
            device.element(self.index, self._deltas, challenge.param_index),
            device.element(self.index, self._opt, challenge.state_index),
        )

    def release_views(self) -> None:
        self._pre = self._post = None
        self._device_computed = None
        super().release_views()
