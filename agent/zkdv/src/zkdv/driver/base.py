"""The shared Driver: one transcript and its asynchronous pipeline, for any frontend.

A frontend (``zkdv.jax`` or ``zkdv.torch``) subclasses :class:`Driver`, turns one
training invocation into a :class:`~zkdv.driver.protocol.Submission` and hands it to
:meth:`Runtime.submit <zkdv.driver.protocol.Runtime.submit>` through
:attr:`Driver.runtime`. The driver owns the transcript (:class:`~zkdv.core.ZKDVCore`)
and the pipeline (:class:`~zkdv.driver.flowcontrol.PipelineQueue`):

1. the training thread is admitted under the transaction's overlap policy
   (``runtime.admit``), dispatches the step, and submits it;
2. the commit stage (one thread, so records stay in step order) reads the post-update
   state, commits batch, state and probes, and decides the sampled check; the moment it
   no longer reads live state it sets the submission's ``released`` event, the
   *mutation barrier* a frontend waits on before donating or mutating that state;
3. a sampled step captures its committed coordinates while the state is still live,
   fences admission as its policy says, and is replayed on the check stage; a failed
   check writes its record and poisons the driver, so the next call, ``join()`` or
   ``close()`` raises :class:`~zkdv.errors.ZKDVPoisonedError`.

In a multi-process run (``jax.distributed`` or ``torch.distributed``) rank 0 owns the
transcript and the other ranks (followers) only train. :meth:`Driver.start` joins rank
0's :class:`~zkdv.driver.control.HostControl` channel; before each step
``runtime.agree`` tells every rank whether rank 0 goes on, and :meth:`Driver.close`
tells every follower the digest and whether the run was poisoned, so all ranks raise at
the same point.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from zkdv import workers
from zkdv._probe_pass import _kernel as probes_kernel
from zkdv.config import GradientBounds, ZKDVConfig, resolve_gradient_files
from zkdv.core import ProgramInfo, State, ZKDVCore
from zkdv.driver.control import HostControl
from zkdv.driver.flowcontrol import Admission, PipelineQueue, unannotated
from zkdv.driver.protocol import Leaves, PendingUpdate, Runtime, Submission
from zkdv.environments import platform_kind
from zkdv.errors import (
    ALREADY_STARTED,
    CLOSED,
    NOT_STARTED,
    ZKDVError,
    ZKDVPoisonedError,
    ZKDVVerificationError,
)
from zkdv.files import (
    TREES,
    batch_path,
    gradient_path,
    program_file,
    snapshot_path,
    write_batch,
    write_state,
)
from zkdv.merkle import PendingCommitment, StateCommitment
from zkdv.overlap import Policy
from zkdv.sampling import Challenge

__all__ = ["Driver"]


class Driver:
    """Own one backend transcript and its asynchronous pipeline lifecycle.

    Args:
        path: proof directory (``records.cborl`` and its sidecars are written there).
        config: run configuration; defaults to :class:`~zkdv.ZKDVConfig()`.
        backend: ``"jax"`` or ``"torch"``.
        annotation: profiler-range factory for pipeline stages.
        max_in_flight: hard ceiling for unresolved transactions.
        replay_snapshot_interval: a replay snapshot every N steps; a checked replay runs
            at most N - 1 transitions before the challenged one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: ZKDVConfig | None,
        *,
        backend: str,
        annotation: Callable[[str], AbstractContextManager[Any]] = unannotated,
        max_in_flight: int,
        replay_snapshot_interval: int,
    ) -> None:
        if replay_snapshot_interval < 1:
            raise ValueError("ZKDV replay_snapshot_interval must be positive")
        if max_in_flight < 1:
            raise ValueError("ZKDV max_in_flight must be positive")
        self.path = Path(path)
        self.config = config if config is not None else ZKDVConfig()
        if not isinstance(self.config, ZKDVConfig):
            raise TypeError("ZKDV config must be a zkdv.ZKDVConfig")
        self._backend = backend
        self._annotation = annotation
        self._max_in_flight = max_in_flight
        self._replay_snapshot_interval = replay_snapshot_interval
        self._queue = PipelineQueue(max_in_flight, annotation)
        self._core: ZKDVCore | None = None
        self._program: ProgramInfo | None = None
        self._experiment: dict[str, str] | None = None
        self._env: dict[str, Any] = {}
        #: The frontend's default gradient bounds for its program (set at sealing).
        self._bounds: GradientBounds | None = None
        # Per-leaf layout description for the root schema (multi-device frontends).
        self._shardings: dict[str, Any] | None = None
        self._next_index = 0
        self._last: PendingUpdate | None = None
        self._closed = False
        self._started = False
        self.rolling_window = 0
        self.probe_ratio = 0.0
        self.digest: bytes | None = None
        # Snapshot and batch files for the platform's replay (zkdv.files); a run
        # without a platform may turn them off with ZKDV_KEEP_FILES=0.
        self._keep_files = os.environ.get("ZKDV_KEEP_FILES", "1") != "0"
        # Multi-process runs: rank 0 owns the tape (see the module docstring).
        self._control: HostControl | None = None
        self._rank = 0
        self._world_size = 1
        self._entries = 0
        self._shared_error: str | None = None
        self._control_done = False
        self._follower_error: str | None = None
        self._runtime = _Runtime(self)

    #: Whether ``start()`` joins the backend's process group through HostControl.
    distributed: ClassVar[bool] = False

    @property
    def runtime(self) -> Runtime:
        """The frontend's interface to this driver (:class:`~zkdv.driver.protocol.Runtime`).

        Frontends call the driver only through it; training code never needs it.
        """
        return self._runtime

    @property
    def follower(self) -> bool:
        """True on a rank other than 0 of a multi-process run: it trains, rank 0 records."""
        return self._rank != 0

    # --- public lifecycle ---------------------------------------------------------------
    @property
    def prover(self) -> str:
        return f"whitebox-{self._backend}"

    @property
    def replay_snapshot_interval(self) -> int:
        return self._replay_snapshot_interval

    @property
    def steps(self) -> int:
        return self._next_index

    def start(self, rolling_window: int, probe_ratio: float = 0.01) -> None:
        """Fix the run's rolling-hash window and probe ratio; call once before training.

        Args:
            rolling_window: words per rolling-hash window within each committed batch
                row; it must not exceed the packed row width (checked at the first step).
            probe_ratio: fraction of each parameter leaf's last dimension kept by its
                orthonormal probe, fixed for the run.
        """
        if self.distributed:
            # Every process calls start(); rank 0 opens the channel, followers connect.
            control = HostControl.for_backend(self._backend)
            if control is not None:
                self._control = control
                self._rank, self._world_size = control.rank, control.size
        if self._closed:
            raise ZKDVError(CLOSED)
        if self._started:
            raise ZKDVError(ALREADY_STARTED)
        if (
            isinstance(rolling_window, bool)
            or not isinstance(rolling_window, int)
            or rolling_window < 1
        ):
            raise ValueError(f"rolling_window={rolling_window!r} must be a positive integer")
        if not 0.0 < float(probe_ratio) <= 1.0:
            raise ValueError(f"probe_ratio={probe_ratio!r} must be in (0, 1]")
        self.rolling_window = rolling_window
        self.probe_ratio = float(probe_ratio)
        if self.follower:
            self._started = True
            return
        self._core = ZKDVCore(
            self.path,
            self.config,
            prover=self.prover,
            rolling_window=rolling_window,
            probe_ratio=self.probe_ratio,
            snapshot_interval=self._replay_snapshot_interval,
            max_in_flight=self._max_in_flight,
            # Writes and fsyncs leave the commit stage: it releases the live state (and
            # the training thread's mutation barrier) without waiting for the disk.
            background_writes=True,
        )
        # The compiled probe pass (zkdv[jit]) is built or loaded now, before training,
        # rather than by the commit stage beside the first steps.
        probes_kernel()
        self._started = True

    def bind_experiment(self, name: str, spec_digest: str) -> None:
        """Bind the transcript to a DVBench experiment (before the first step)."""
        if self._core is not None and self._core.opened:
            raise ZKDVError("bind the experiment before the first training step")
        regime = (self._experiment or {}).get("regime")
        self._experiment = {"name": name, "spec_digest": spec_digest}
        if regime is not None:
            self._experiment["regime"] = regime

    def declare_regime(self, regime: str) -> None:
        """Declare the run's training regime (``"pretraining"``, ``"fine-tuning"``, ``"rl"``, ...).

        Recorded in the root record with the experiment binding (``experiment.regime``),
        so the platform checks it against the spec's allowed regimes; the transcript
        binds one program for the whole run, so the regime cannot change mid-run
        unseen. Call before the first step.
        """
        if not isinstance(regime, str) or not regime:
            raise ValueError(f"regime={regime!r} must be a non-empty string")
        if self._core is not None and self._core.opened:
            raise ZKDVError("declare the regime before the first training step")
        self._experiment = {**(self._experiment or {}), "regime": regime}

    def join(self) -> None:
        """Wait for every queued commitment and sampled check without closing.

        On return every record of the steps submitted so far is committed: written to
        the transcript, with the files it refers to (``docs/transcript.md``,
        "Durability").
        """
        self._queue.join()
        self._flush()

    def _flush(self) -> None:
        """Wait for the transcript's writer; a failed write poisons the pipeline."""
        core = self._core
        if core is None:
            return
        try:
            core.flush()
        except OSError as error:  # the writer's failure (zkdv.records)
            self._queue.poison(error)
            self._queue.check()

    def close(self) -> None:
        """Wait for all commitments and checks, flush the tape, release resources.

        In a multi-process run rank 0 tells every follower the transcript digest and
        whether the run was poisoned, so ``close()`` raises on every rank alike.

        Raises:
            ZKDVPoisonedError: an asynchronous commitment or sampled check failed
                (again on every later call).
        """
        if self.follower:
            self._closed = True
            control = self._control
            if not self._control_done and control is not None:
                self._control_done = True
                try:
                    outcome = control.exchange("zkdv.close")
                finally:
                    control.close()
                self.digest = bytes.fromhex(outcome["digest"]) if outcome["digest"] else None
                self._follower_error = outcome["error"]
            if self._follower_error:
                raise ZKDVPoisonedError(
                    f"rank 0's ZKDV transcript is poisoned: {self._follower_error}"
                )
            return
        failure: BaseException | None = None
        try:
            if not self._closed:
                self._closed = True
                try:
                    self._queue.join(raise_poison=False)
                finally:
                    self._queue.close()
                    core = self._core
                    if core is not None and core.opened:
                        try:
                            self.digest = core.close()
                        except OSError as error:  # the writer failed: the run is poisoned
                            self._queue.poison(error)
            self._queue.check()
        except ZKDVPoisonedError as error:
            failure = error
        finally:
            self._release_followers(failure)
        if failure is not None:
            raise failure

    def _release_followers(self, failure: BaseException | None) -> None:
        """Rank 0: tell every follower the transcript digest and whether it is poisoned."""
        control = self._control
        if control is None or self._control_done:
            return
        self._control_done = True
        outcome = {
            "digest": self.digest.hex() if self.digest else None,
            "error": None if failure is None else str(failure),
        }
        try:
            control.exchange("zkdv.close", outcome)
        finally:
            control.close()

    def _agree(self, policy: Any, *, barrier: bool = False) -> Admission | None:
        """Every rank learns, before the step's collectives, whether rank 0 goes on.

        Rank 0 is admitted first (admission is where a failed check surfaces) and
        publishes the outcome over HostControl; followers wait for it. All ranks
        therefore raise :class:`ZKDVPoisonedError` at the same step instead of one
        leaving a collective the others are blocked in. With ``barrier`` rank 0 also
        waits, before it publishes, for the previous commitment to release the state
        this step donates: once the followers are told to go on, rank 0 must dispatch
        the step.

        Returns:
            Rank 0's admission; None on a follower.
        """
        control = self._control
        assert control is not None
        if self._shared_error is not None:
            raise ZKDVPoisonedError(self._shared_error)
        key = f"zkdv.step.{self._entries}"
        self._entries += 1
        admission = None
        if self.follower:
            decision = control.exchange(key)
        else:
            try:
                admission = self._admit(policy)
                if barrier and self._last is not None:
                    self._barrier()
            except ZKDVPoisonedError as error:
                if admission is not None:
                    admission.cancel()
                    admission = None
                decision = str(error)
            else:
                decision = None
            decision = control.exchange(key, decision)
        if decision is not None:
            if admission is not None:
                admission.cancel()
            self._shared_error = str(decision)
            raise ZKDVPoisonedError(self._shared_error)
        return admission

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the frontend interface (Driver.runtime) -----------------------------------------
    def _check_started(self) -> None:
        if self._closed:
            raise ZKDVError(CLOSED)
        if not self._started:
            raise ZKDVError(NOT_STARTED)

    def _require_step(self) -> None:
        if not self.follower:
            try:
                self._require_running()
            except ZKDVPoisonedError as error:
                self._announce_failure(error)
                raise
            return
        self._check_started()
        if self._shared_error is not None:
            raise ZKDVPoisonedError(self._shared_error)

    def _announce_failure(self, error: BaseException) -> None:
        """Rank 0 failed before its step: tell the followers, who wait for that step."""
        control = self._control
        if control is None or self.follower or self._shared_error is not None:
            return
        self._shared_error = (
            str(error)
            if isinstance(error, ZKDVPoisonedError)
            else f"rank 0 failed before step {self.steps}: {error}"
        )
        key = f"zkdv.step.{self._entries}"
        self._entries += 1
        with contextlib.suppress(Exception):
            control.exchange(key, self._shared_error)

    def _require_running(self) -> ZKDVCore:
        if self._closed:
            raise ZKDVError(CLOSED)
        self._queue.check()
        if self._core is None:
            raise ZKDVError(NOT_STARTED)
        return self._core

    def _set_program(
        self,
        kind: str,
        material: bytes | bytearray | memoryview,
        env: dict[str, Any],
        shardings: dict[str, Any] | None,
        bounds: GradientBounds | None = None,
    ) -> ProgramInfo:
        """Record the attested artifact's exact bytes beside the transcript."""
        core = self._require_running()
        if core.opened:
            raise ZKDVError("the attested program is fixed by the first step and cannot change")
        info = ProgramInfo.of(kind, material)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / program_file(kind)).write_bytes(bytes(material))
        self._program = info
        self._env = env
        self._bounds = bounds
        if shardings is not None:
            self._shardings = shardings
        return info

    @property
    def _keeps_gradient_files(self) -> bool:
        """Whether each step's computed values are written (``ZKDVConfig.gradient_files``
        for the platform the program was sealed on)."""
        return self._keep_files and self._gradient_files == "always"

    @property
    def _gradient_files(self) -> str:
        kind = platform_kind({"env": self._env})
        return resolve_gradient_files(self.config.gradient_files, kind)

    def _snapshot_due(self, index: int) -> bool:
        return index % self._replay_snapshot_interval == 0

    def _admit(self, policy: Policy) -> Admission:
        """Block until a transaction of ``policy`` may start; raises once poisoned."""
        self._require_running()
        return self._queue.acquire(Policy(policy))

    def _barrier(self, raise_poison: bool = True) -> bool:
        """Wait until the previous step's commitment stopped reading live state."""
        last = self._last
        if last is not None and not last.released.is_set():
            with workers.waiting():
                while not last.released.wait(0.05):
                    if not raise_poison and self._queue.poisoned is not None:
                        # A poisoned pipeline skips the commitment waited for.
                        return False
                    if raise_poison:
                        self._queue.check()
        if raise_poison:
            self._queue.check()
        return True

    def _submit(self, admission: Admission, submission: Submission) -> PendingUpdate:
        """Queue one dispatched step's commitment (and, if sampled, its check)."""
        core = self._require_running()
        pending = PendingUpdate(self._next_index, submission)
        self._next_index += 1
        if not submission.started:
            submission.started = core.clock()
        admission.register(pending.retired)
        self._last = pending
        try:
            self._queue.submit_commit(self._commit, core, pending)
        except BaseException:
            pending.released.set()
            pending.retired.set()
            raise
        return pending

    # --- pipeline stages ----------------------------------------------------------------
    def _write_snapshot(
        self, step: int, snapshot: tuple[Leaves, Leaves, Leaves], sub: Submission
    ) -> None:
        try:
            for tree, leaves in zip(TREES, snapshot, strict=True):
                write_state(snapshot_path(self.path, step, tree), leaves)
        finally:
            sub.snapshot_written()

    def _commit(self, core: ZKDVCore, pending: PendingUpdate) -> None:
        sub = pending.submission
        hashing: list[PendingCommitment] = []

        def start(state: State) -> State:
            # Host leaves go to the hashing pool at once: the probes, the batch and the
            # records are this thread's work beside it, not after it.
            if isinstance(state, StateCommitment | PendingCommitment):
                return state
            started = core.start_commit(state)
            hashing.append(started)
            return started

        try:
            computed = sub.computed()
            grad = None if computed is None else start(computed[0])
            if not core.opened:
                # Hashed once: the first step's commitment also fixes the root's schema.grad.
                self._open(core, sub, None if grad is None else core.commit(grad))
            batch = sub.batch()
            if self._keep_files:
                self._submit_step_files(core, pending.index, batch, computed)
            if sub.snapshot is not None:
                self._record_snapshot(core, pending)
            params, opt_state, buffers = (start(tree) for tree in sub.post_state())
            assert core.probes is not None
            probes = sub.probes(core.probes)
            result = core.commit_step(
                pending.index,
                batch=batch,
                params=params,
                opt_state=opt_state,
                buffers=buffers,
                probes=probes,
                tokens=sub.tokens,
                flops=sub.flops,
                started=sub.started,
                hyperparameters=sub.hyperparameters,
                grad=grad,
            )
            pending.result = result
            self._hand_on(core, pending, result.challenge)
        except BaseException:
            for started in hashing:
                started.wait()  # the state is released only once nothing reads it
            pending.released.set()
            pending.retired.set()
            sub.retire()
            raise

    def _open(self, core: ZKDVCore, sub: Submission, grad: StateCommitment | None) -> None:
        """Write the root record, from the first committed step's initial state and batch."""
        params, opt_state, buffers = sub.initial_state()
        bound = self._experiment
        # A regime is recorded only with an experiment binding: the root's
        # experiment map is {name, spec_digest[, regime]} or null.
        core.experiment = bound if bound is not None and "name" in bound else None
        batch = sub.batch()
        core.open(
            params=params,
            opt_state=opt_state,
            buffers=buffers,
            batch_cols=int(np.asarray(batch).reshape(len(batch), -1).shape[1]),
            program=self._program,
            env=self._env,
            shardings=self._shardings,
            grad=None if grad is None else grad.specs,
            bounds=self._bounds,
            gradient_files=self._gradient_files,
        )

    def _submit_step_files(
        self,
        core: ZKDVCore,
        index: int,
        batch: np.ndarray,
        computed: tuple[State, Leaves | None] | None,
    ) -> None:
        """Queue the step's batch file, and its gradient file if it has one."""
        # On the writer, ahead of the step's record: the record is committed
        # only after its files are (docs/transcript.md, "Durability").
        words = np.asarray(batch)
        core.submit_file(
            functools.partial(write_batch, batch_path(self.path, index), words),
            words.nbytes,
        )
        if computed is not None and computed[1] is not None and self._keeps_gradient_files:
            leaves = computed[1]
            core.submit_file(
                functools.partial(write_state, gradient_path(self.path, index), leaves),
                sum(np.asarray(array).nbytes for _, array in leaves),
            )

    def _record_snapshot(self, core: ZKDVCore, pending: PendingUpdate) -> None:
        """Record the snapshot of the step's pre-state, and queue its files if kept."""
        sub = pending.submission
        snapshot = sub.snapshot
        assert snapshot is not None
        sub.snapshot = None
        assert core.last_roots is not None
        # Its roots are the post roots of the previous step, already computed:
        # the file needs no second hash; the platform recomputes them.
        core.record_snapshot(pending.index, core.last_roots, {})
        if self._keep_files:
            self._queue.submit_snapshot(self._write_snapshot, pending.index, snapshot, sub)

    def _hand_on(self, core: ZKDVCore, pending: PendingUpdate, challenge: Challenge | None) -> None:
        """After the step's record: retire an unsampled step; queue a sampled one's check."""
        sub = pending.submission
        if challenge is None:
            sub.release_views()
            pending.released.set()
            sub.retire()
            pending.retired.set()
            return
        committed = sub.capture(challenge)
        sub.release_views()
        pending.released.set()
        done, acquired = threading.Event(), threading.Event()
        # The fence is registered before retirement so no admission slips between.
        self._queue.fence(done, sub.policy, acquired=acquired)
        pending.retired.set()
        self._queue.submit_check(self._check, core, pending, challenge, committed, done, acquired)

    def _check(
        self,
        core: ZKDVCore,
        pending: PendingUpdate,
        challenge: Challenge,
        committed: tuple[float, float],
        done: threading.Event,
        acquired: threading.Event,
    ) -> None:
        sub = pending.submission
        try:
            acquired.set()
            # A replay may read the files of its window (committed gradients).
            core.flush()
            outcome = sub.replay(challenge)
            if outcome.committed_delta is not None:
                committed = (outcome.committed_delta, committed[1])
            ok = core.record_check(
                challenge,
                committed_delta=committed[0],
                replayed_delta=outcome.replayed_delta,
                committed_state=committed[1],
                replayed_state=outcome.replayed_state,
                replay_from=outcome.replay_from,
                replayed_steps=outcome.replayed_steps,
                gradient_within=outcome.gradient_within,
            )
        finally:
            sub.retire()
            done.set()
        if not ok and outcome.gradient_within is False:
            raise ZKDVVerificationError(
                f"sampled check of step {challenge.step} failed: the gradient recomputed "
                f"from its committed batch lies outside the run's gradient bounds of the "
                f"committed one"
            )
        if not ok:
            tol = self.config.tolerance
            raise ZKDVVerificationError(
                f"sampled check of step {challenge.step} failed: parameter "
                f"{challenge.param_index} update committed {committed[0]!r}, replayed "
                f"{outcome.replayed_delta!r}; optimizer state {challenge.state_index} "
                f"committed {committed[1]!r}, replayed {outcome.replayed_state!r} "
                f"(tolerance abs {tol.absolute:g}, rel {tol.relative:g})"
            )


class _Runtime:
    """:class:`~zkdv.driver.protocol.Runtime` over one driver's private state."""

    __slots__ = ("_driver",)

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    @property
    def core(self) -> ZKDVCore | None:
        return self._driver._core

    @property
    def closed(self) -> bool:
        return self._driver._closed

    @property
    def keep_files(self) -> bool:
        return self._driver._keep_files

    @property
    def keep_gradient_files(self) -> bool:
        return self._driver._keeps_gradient_files

    @property
    def max_in_flight(self) -> int:
        return self._driver._max_in_flight

    @property
    def rank(self) -> int:
        return self._driver._rank

    @property
    def world_size(self) -> int:
        return self._driver._world_size

    @property
    def multi_process(self) -> bool:
        return self._driver._control is not None

    def check_started(self) -> None:
        self._driver._check_started()

    def require_running(self) -> ZKDVCore:
        return self._driver._require_running()

    def require_step(self) -> None:
        self._driver._require_step()

    def admit(self, policy: Policy) -> Admission:
        return self._driver._admit(policy)

    def agree(self, policy: Any, *, barrier: bool = False) -> Admission | None:
        return self._driver._agree(policy, barrier=barrier)

    def barrier(self, *, raise_poison: bool = True) -> bool:
        return self._driver._barrier(raise_poison)

    def snapshot_due(self, index: int) -> bool:
        return self._driver._snapshot_due(index)

    def submit(self, admission: Admission, submission: Submission) -> PendingUpdate:
        return self._driver._submit(admission, submission)

    def set_program(
        self,
        kind: str,
        material: bytes | bytearray | memoryview,
        *,
        env: dict[str, Any],
        shardings: dict[str, Any] | None = None,
        bounds: GradientBounds | None = None,
    ) -> ProgramInfo:
        return self._driver._set_program(kind, material, env, shardings, bounds)

    @property
    def poisoned(self) -> BaseException | None:
        return self._driver._queue.poisoned

    def check(self) -> None:
        self._driver._queue.check()

    def poison(self, error: BaseException) -> None:
        self._driver._queue.poison(error)

    def share_failure(self, message: str) -> None:
        self._driver._shared_error = message

    def announce_failure(self, error: BaseException) -> None:
        self._driver._announce_failure(error)

    def exchange(self, key: str, value: Any = None) -> Any:
        control = self._driver._control
        assert control is not None, "HostControl exchanges happen in multi-process runs only"
        return control.exchange(key, value)
