"""The JAX driver: ``zkdv.jax.ZKDV`` with ``jit`` (the training step) and ``attest``.

One ``proof.jit`` invocation is one transcript transaction. The wrapper flattens the
call's dynamic arguments into leaves, runs one compiled program that returns the user's
result *and* the transaction's hidden values (additive deltas, post-update parameters
and optimizer state, the packed uint32 batch; :class:`~zkdv.compilation.ResultSchema`
lays them out so a value the user also returns crosses the program boundary once), and
hands a :class:`_Step` to the shared :class:`~zkdv.driver.Driver` pipeline, which
commits it on its own thread. A run that commits its gradients runs the two committed
programs instead (:meth:`ZKDV._run`): the exported step, which returns the computed
values, then the apply program, whose outputs take the hidden values' place. The design, the batch packing and the artifact format
are documented in ``docs/jax.md``.

Under ``jax.distributed`` (several processes, one SPMD program) process 0 owns the
transcript; the others (followers) run the same program and learn over
:class:`~zkdv.driver.control.HostControl`, before each step, whether rank 0 may go on, so every
process stops at the same step. The packed batch (and the gradient) is all-gathered inside the step, so
rank 0 commits the global batch without a separate collective, and the committed state
must be replicated across processes (data parallelism; sharding within a process is
free).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zkdv.batch import validate_window
from zkdv.config import GradientBounds, ZKDVConfig
from zkdv.driver import Driver, ReplayOutcome
from zkdv.errors import ZKDVError, ZKDVVerificationError
from zkdv.jax import _messages
from zkdv.jax._device import (
    DeviceCommitter,
    SnapshotPool,
    TransferLog,
    host_sharding,
    host_shardings,
    leaf_specs,
)
from zkdv.jax._export import (
    _SOURCES,
    _apply_state_specs,
    _attest_from_transition,
    _check_attest_outputs,
    _committed_material,
    _computed_specs,
    _derived_transition,
    _environment,
    _export_programs,
    _flat_attest,
    _spec,
    _unreplicated,
    donates_params,
    export_committed,
    follower_calls,
    precision,
    state_shardings,
    step_calls,
)
from zkdv.jax._optimizer import apply_function, deltas, optimizer_env
from zkdv.jax._program import (
    JIT_OPTIONS,
    JitFunction,
    _check_options,
    _Program,
    _Traced,
)
from zkdv.jax._steps import _DeviceStep, _select, _Step
from zkdv.jax.artifact import Artifact, dumps
from zkdv.jax.device_merkle import default_schedule
from zkdv.overlap import Policy
from zkdv.sampling import Challenge
from zkdv.signature import FunctionSignature

__all__ = ["JIT_OPTIONS", "ZKDV", "JitFunction"]


def _annotation(name: str) -> contextlib.AbstractContextManager[Any]:
    return jax.profiler.TraceAnnotation(name)


def _host_copy(leaves: Sequence[Any]) -> list[np.ndarray]:
    # np.array copies: the source buffers are about to be donated. Python scalars (a
    # fresh TrainState's step) take JAX's dtype, as the compiled program sees them.
    return [
        np.array(leaf)
        if isinstance(leaf, jax.Array | np.ndarray)
        else np.asarray(jnp.asarray(leaf))
        for leaf in leaves
    ]


def _to_host(leaf: Any) -> Any:
    """Launch an asynchronous copy of ``leaf`` into host memory (pinned when offered).

    JAX orders the copy before any later program that donates ``leaf``, so the
    training thread never waits for it.
    """
    if not isinstance(leaf, jax.Array):
        return np.array(leaf)
    target = host_sharding(leaf.sharding)
    if target is None:
        return jax.device_put(leaf, leaf.sharding, may_alias=False)
    return jax.device_put(leaf, target, may_alias=False)


def _nbytes(leaf: Any) -> int:
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(jnp.result_type(leaf)).itemsize


class ZKDV(Driver):
    """The JAX transcript driver (``zkdv.jax.ZKDV``).

    Args:
        path: proof directory; ``records.cborl``, ``probes.bin``, the program artifact
            and the snapshot and batch files are written there.
        config: run configuration (sampling policy, tolerance, chunk size).
        max_in_flight: hard ceiling for unresolved pipeline transactions.
        replay_snapshot_interval: a full pre-state copy every N steps; a checked
            replay starts at the latest snapshot and replays at most N - 1 transitions.
    """

    distributed = True

    def __init__(
        self,
        path: Any,
        config: ZKDVConfig | None = None,
        *,
        max_in_flight: int = 2,
        replay_snapshot_interval: int = 12,
    ) -> None:
        super().__init__(
            path,
            config,
            backend="jax",
            annotation=_annotation,
            max_in_flight=max_in_flight,
            replay_snapshot_interval=replay_snapshot_interval,
        )
        self._attested: tuple[Callable[..., Any], dict[str, Any]] | None = None
        self._states_created = 0
        self._program_owner: _Program | None = None
        self._artifact: Artifact | None = None
        self._store_lock = threading.Lock()
        self._snapshots: dict[int, tuple[list[Any], list[Any]]] = {}
        self._batches: dict[int, np.ndarray] = {}
        self._checks_pending: set[int] = set()
        self._committed_through = -1
        self._last_outputs: list[weakref.ref[Any]] | None = None
        self._last_post_probe: list[np.ndarray] | None = None
        #: The last committed step's probed post-update rows (``_Step.probes``): the
        #: next step's pre-update rows, where the apply program writes over them.
        self._post_rows: list[np.ndarray] | None = None
        self._log = TransferLog()
        self._path: str | None = None
        self._device: DeviceCommitter | None = None
        self._pool: SnapshotPool | None = None
        # Pool slots in use by snapshots, and the two events that free them: the
        # snapshot is no longer needed for a replay, and its file is written.
        self._slots: dict[int, list[Any]] = {}
        self._slot_pending: dict[int, int] = {}

    # -- public API ---------------------------------------------------------------------
    def jit(self, fun: Callable[..., Any] | None = None, /, **options: Any) -> Any:
        """Compile a training step whose every call is one transcript transaction.

        Accepts every ``jax.jit`` option (``in_shardings``, ``out_shardings``,
        ``static_argnums``, ``static_argnames``, ``donate_argnums``,
        ``donate_argnames``, ``keep_unused``, ``device``, ``backend``, ``inline``,
        ``compiler_options``) and works as a decorator with or without options, or as a
        callable: ``proof.jit(step, donate_argnums=(0,))``.

        Raises:
            TypeError: an option ``jax.jit`` does not have.
        """
        _check_options(options, "ZKDV.jit")
        if fun is None:
            return lambda function: JitFunction(self, function, options)
        return JitFunction(self, fun, options)

    def attest(self, fun: Callable[..., Any] | None = None, /, **options: Any) -> Any:
        """Register the attested program of the explicit ``Transaction`` API.

        Its ABI is fixed: ``(params, opt_state, batch, parameter_index,
        optimizer_state_index) -> (selected_delta, selected_post_optimizer_state)``,
        both outputs scalar floats, both indices ``uint64`` scalars. It is exported with
        ``jax.export`` at the first step and its bytes are committed. ``jax.jit`` options
        apply to it; an explicit ``out_shardings`` is ignored with a warning.

        Returns:
            The function compiled with ``jax.jit`` and the given options.

        Raises:
            ZKDVError: an attested function is already registered.
        """
        _check_options(options, "ZKDV.attest")
        if "out_shardings" in options:
            warnings.warn(
                "ZKDV.attest ignores out_shardings: the attested program's outputs are "
                "two scalars whose layout the protocol fixes",
                stacklevel=2,
            )
            options = {k: v for k, v in options.items() if k != "out_shardings"}

        def register(function: Callable[..., Any]) -> Any:
            if self._attested is not None:
                raise ZKDVError(_messages.ATTEST_TWICE)
            if self._program_owner is not None:
                raise ZKDVError("register the attested function before the first step")
            FunctionSignature(function, "ZKDV.attest")
            self._attested = (function, dict(options))
            return jax.jit(function, **options)

        if fun is None:
            return register
        return register(fun)

    def close(self) -> None:
        """Wait for every commitment and check, write the close record, release resources.

        Raises:
            ZKDVPoisonedError: an asynchronous commitment or sampled check failed.
            ZKDVError: a TrainState was created with this proof but no proof.jit step
                ran (the step still uses ``jax.jit``).
        """
        first = not self.runtime.closed
        try:
            super().close()
        finally:
            with self._store_lock:
                self._snapshots.clear()
                self._batches.clear()
                self._slots.clear()
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.close()
        if first and not self.follower and self._states_created and self.steps == 0:
            raise ZKDVError(_messages.NO_TRANSCRIPT_UPDATE)

    @property
    def artifact(self) -> Artifact | None:
        """The committed program artifact (after the first step)."""
        return self._artifact

    @property
    def commitments(self) -> str | None:
        """Where this run's commitments are computed, ``"host"`` or ``"device"``: the
        resolved ``ZKDVConfig.commitments`` (None before the first step)."""
        return self._path

    @property
    def transfers(self) -> TransferLog:
        """Bytes this proof read from the device to the host, per step and kind."""
        return self._log

    # -- frontend internals ----------------------------------------------------------------
    def _note_state(self) -> None:
        self._states_created += 1

    def _install(
        self,
        program: _Program,
        leaves: list[Any],
        replay_builder: Callable[[_Traced], Callable[..., Any]],
    ) -> None:
        """Export and commit the attested program; fix the environment (first step)."""
        traced = program.traced
        validate = traced.layout
        try:
            validate_window(self.rolling_window, validate.cols)
        except ValueError as error:
            raise ValueError(
                f"{error}. The packed batch of this step has {validate.rows} rows of "
                f"{validate.cols} words (docs/jax.md, 'Batch packing'); pass "
                f"proof.start(rolling_window=...) at most {validate.cols}"
            ) from None
        params = [leaves[i] for i in traced.param_positions]
        opt = [leaves[i] for i in traced.opt_positions]
        if jax.process_count() > 1:
            # Every process sees the same global shardings, so all raise here alike.
            split = _unreplicated(params, traced.param_paths) + _unreplicated(opt, traced.opt_paths)
            if split:
                raise ZKDVError(
                    _messages.MULTI_PROCESS_SHARDED.format(
                        count=jax.process_count(), leaves=", ".join(split[:4])
                    )
                )
        if self.follower:
            # Rank 0 exports and commits the program; a follower only runs it (in a run
            # that commits its gradients, the same partitioned programs as rank 0).
            if traced.commits:
                program.jitted, program.apply, program.deltas = follower_calls(
                    program, (params, opt)
                )
            self._program_owner = program
            return
        try:
            self._export(program, params, opt, replay_builder)
        except BaseException as error:
            # Only rank 0 exports: the followers, already waiting for this step's
            # decision, must learn that it will not come.
            self.runtime.announce_failure(error)
            raise

    def _export(
        self,
        program: _Program,
        params: list[Any],
        opt: list[Any],
        replay_builder: Callable[[_Traced], Callable[..., Any]],
    ) -> None:
        traced = program.traced
        validate = traced.layout
        param_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in params)
        opt_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in opt)
        batch_spec = _spec((validate.rows, validate.cols), jnp.uint32)
        index_spec = _spec((), jnp.uint64)
        registration = traced.registration
        scan = registration.scan
        if traced.commits or (scan is not None and scan.spec is not None):
            if self._attested is not None:
                source = registration.source
                raise ZKDVError(_messages.ATTEST_COMMITTED.get(source, _messages.ATTEST_REGISTERED))
            if scan is not None:  # zkdv.jax.scan: the programs of one of its updates
                self._artifact = scan.commit_programs(self.runtime, traced, params, opt)
                self._program_owner = program
                return
            self._export_committed(program, params, opt, param_specs, opt_specs)
            return
        if registration.source != "transaction":
            if self._attested is not None:
                raise ZKDVError(_messages.ATTEST_REGISTERED)
            # A zkdv.jax.scan of a run without gradients (attest_apply_fn) brings its
            # one-update transition; otherwise the staged function is replayed up to its
            # update boundary.
            generated = scan.transition if scan is not None else replay_builder(traced)
            transition: Callable[..., Any] | None = generated
            attest = _attest_from_transition(generated)
            options: dict[str, Any] = {}
            source = _SOURCES[registration.source] + (" in zkdv.jax.scan" if scan else "")
        else:
            if self._attested is None:
                raise ZKDVError(_messages.NO_ATTEST)
            function, options = self._attested
            attest = _flat_attest(function, traced)
            transition = _derived_transition(function, traced, param_specs, opt_specs, batch_spec)
            source = "ZKDV.attest"
            if transition is None and self.replay_snapshot_interval > 1:
                raise ZKDVError(
                    _messages.NO_TRANSITION.format(
                        interval=self.replay_snapshot_interval,
                        steps=self.replay_snapshot_interval - 1,
                    )
                )
        try:
            exported_attest, exported_transition = _export_programs(
                attest, options, transition, (param_specs, opt_specs, batch_spec, index_spec)
            )
        except ZKDVError:
            raise
        except Exception as error:
            raise ZKDVError(_messages.EXPORT_FAILURE.format(error=error)) from error
        _check_attest_outputs(exported_attest)
        material = dumps(
            source=source,
            attest=exported_attest,
            transition=exported_transition,
            params=list(zip(traced.param_paths, param_specs, strict=True)),
            opt_state=list(zip(traced.opt_paths, opt_specs, strict=True)),
            layout=traced.layout,
        )
        self.runtime.set_program(
            "jax.export",
            material,
            env=_environment(platforms=exported_attest.platforms),
            shardings=state_shardings(params, opt),
        )
        # Replays use the committed bytes themselves, so a check also tests the artifact.
        self._artifact = Artifact.loads(material)
        self._program_owner = program

    def _export_committed(
        self,
        program: _Program,
        params: list[Any],
        opt: list[Any],
        param_specs: tuple[Any, ...],
        opt_specs: tuple[Any, ...],
    ) -> None:
        """Export, commit and load the programs of a run that commits its gradients.

        The production step is exported as the program that computes the step's
        gradient, carried values and result (the state update it traced is dead code),
        and the apply program as the canonical update of what it computed
        (``docs/jax.md``, "One program"). The step then runs both, deserialized from
        the committed bytes and compiled here, once: the SDK's checks and the
        platform's replay run the same programs.
        """
        traced = program.traced
        spec = traced.update
        assert spec is not None and program.specs is not None
        apply_params, apply_opt, zero_spec = _apply_state_specs(program)
        # Traced without donation: the apply program reads the parameters after it.
        # Under several processes, traced without their mesh (_Program.exported_from).
        production, trace = program.exported_from or program.jitted, program.trace
        apply, outcome = apply_function(spec)
        apply_computed = _computed_specs(program, spec.weak[2])
        exported, applied = export_committed(
            production, program.specs, apply, (apply_params, apply_opt, apply_computed, zero_spec)
        )
        optimizer = optimizer_env(outcome[0] if outcome else None)
        donate = donates_params(program)
        # Committed on the host, the delta probes are formed from the probed rows
        # (_Step.probes); on the device, or where another process holds the state, from
        # the realized deltas, computed after the apply program into the donated
        # pre-update parameters' buffers when the step donates them. (A zkdv.jax.scan
        # does not come here: ScanUpdates.commit_programs.)
        program.host_deltas = (
            self._resolve(program, [*params, *opt]) is None and not self.runtime.multi_process
        )
        if not program.host_deltas:
            program.deltas = jax.jit(deltas, donate_argnums=(1,) if donate else ())
        material = _committed_material(
            program, (exported, applied), apply_computed, optimizer, (param_specs, opt_specs)
        )
        artifact = Artifact.loads(material)
        program.jitted, program.apply = step_calls(
            artifact,
            program,
            apply,
            (apply_params, apply_opt, apply_computed, zero_spec),
            (params, opt),
            donating=program.host_deltas and donate,
        )
        kind = precision(trace.jaxpr, params, jax.default_backend())
        self.runtime.set_program(
            "jax.export",
            material,
            env=_environment(platforms=exported.platforms, precision=kind, update=optimizer),
            bounds=GradientBounds.default(kind["kind"]),
            shardings=state_shardings(params, opt),
        )
        self._artifact = artifact
        self._program_owner = program

    def _run(
        self, program: _Program, leaves: Sequence[Any], barrier: Callable[[], Any] | None = None
    ) -> Sequence[Any]:
        """Dispatch one step: its outputs laid out as ``program.traced.schema`` says.

        A run that commits gradients runs its two committed programs: the production
        step (gradient, carried values, batch, result) and the apply program (the
        post-update state), then the realized deltas; they take the hidden values' place.
        With ``program.host_deltas`` there are no realized deltas: their places hold None.

        ``barrier`` (the mutation barrier) is called before the first program that may
        donate: the apply program, so that the production step, which donates nothing,
        runs while the previous commitment still reads the state.
        """
        donated = tuple(leaves[i] for i in program.donated)
        kept = tuple(leaves[i] for i in program.kept)
        if program.apply is None:
            if barrier is not None:
                barrier()
            return program.jitted(donated, kept, program.zero)  # type: ignore[no-any-return]
        traced = program.traced
        outputs = program.jitted(donated, kept, program.zero)
        if barrier is not None:
            barrier()
        computed = tuple(outputs[1 : 1 + len(traced.computed_names)])
        params = tuple(leaves[i] for i in traced.param_positions)
        params_after, opt_after = program.apply(
            params, tuple(leaves[i] for i in traced.opt_positions), computed, program.zero
        )
        if program.host_deltas:
            return [*(None for _ in params), *params_after, *opt_after, *outputs]
        changes = program.deltas(params_after, params)
        return [*changes, *params_after, *opt_after, *outputs]

    def _continues(self, leaves: Sequence[Any]) -> bool:
        references = self._last_outputs
        if references is None or len(references) != len(leaves):
            return False
        return all(reference() is leaf for reference, leaf in zip(references, leaves, strict=True))

    def _step(self, program: _Program, leaves: list[Any], policy: Policy | None) -> Any:
        traced = program.traced
        if policy is None:
            policy = traced.registration.overlap or Policy.UNCHECKED
        state = [leaves[i] for i in traced.param_positions]
        nparams = len(state)
        state += [leaves[i] for i in traced.opt_positions]
        runtime = self.runtime
        if not runtime.multi_process:
            admission = runtime.admit(policy)
        else:
            agreed = runtime.agree(policy, barrier=bool(program.donated))
            if agreed is None:  # a follower: run the step, record nothing
                outputs = self._run(program, leaves)
                return traced.schema.user_result(outputs, program.trees)
            admission = agreed
        with admission:
            index = self.steps
            device = self._resolve(program, state)
            if device is not None:
                return self._device_step(program, leaves, state, nparams, policy, admission)
            host_pre = None
            if index == 0 or not self._continues(state):
                # The first step's pre-state is the transcript's initial state; a later
                # step whose inputs are not the previous outputs must prove continuity.
                # Either way it is read now, before donation can reuse its buffers.
                copies = _host_copy(state)
                host_pre = (copies[:nparams], copies[nparams:])
                self._log.add(index, "state", sum(a.nbytes for a in copies))
            snapshot = None
            if runtime.snapshot_due(index):
                if host_pre is not None:
                    snapshot = host_pre
                else:
                    copied = self._snapshot_copy(index, state)
                    snapshot = (copied[:nparams], copied[nparams:])
                with self._store_lock:
                    self._snapshots[index] = snapshot
            barrier = None
            if (
                program.donated
                and self.steps > 0
                and not runtime.multi_process
                and traced.registration.scan is None
            ):
                # The previous commitment may still read host views of the buffers this
                # step donates; with a live view JAX silently skips the donation. (A
                # zkdv.jax.scan call's commitments read only its stacked outputs, never
                # the final state the next call donates.)
                barrier = runtime.barrier
            outputs = self._run(program, leaves, barrier)
            schema = traced.schema
            result = schema.user_result(outputs, program.trees)
            hidden = outputs[traced.delta_leaves : schema.hidden_leaves]
            self._last_outputs = [weakref.ref(leaf) for leaf in hidden]
            scan = traced.registration.scan
            if scan is None:
                step = _Step(self, program, index, policy, outputs, host_pre, snapshot)
                runtime.submit(admission, step)
            else:
                scan.submit(self, program, index, policy, outputs, host_pre, snapshot, admission)
        return result

    def _device_step(
        self,
        program: _Program,
        leaves: list[Any],
        state: list[Any],
        nparams: int,
        policy: Policy,
        admission: Any,
    ) -> Any:
        """Dispatch one step and its device-side commitments; nothing waits for them.

        No mutation barrier: the commit stage holds no host view of the state, and JAX
        orders every program that reads a buffer before a later one that donates it.
        """
        traced = program.traced
        device = self._device
        assert device is not None
        index = self.steps
        state = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
        params, opt = state[:nparams], state[nparams:]
        pre = None
        if index == 0 or not self._continues(state):
            specs = (leaf_specs(traced.param_paths, params), leaf_specs(traced.opt_paths, opt))
            if index == 0:
                core = self.runtime.core
                assert core is not None
                device.start_probes(core.probe_set(specs[0]))
            pre = (device.roots(params), device.roots(opt), device.project(params), specs)
        snapshot = None
        if self.runtime.snapshot_due(index):
            copied = self._snapshot_copy(index, state)
            snapshot = (copied[:nparams], copied[nparams:])
            with self._store_lock:
                self._snapshots[index] = snapshot
        outputs = self._run(program, leaves)
        schema = traced.schema
        result = schema.user_result(outputs, program.trees)
        hidden = outputs[traced.delta_leaves : schema.hidden_leaves]
        self._last_outputs = [weakref.ref(leaf) for leaf in hidden]
        nd = traced.delta_leaves
        deltas = list(outputs[:nd])
        params_after = list(outputs[nd : nd + nparams])
        opt_after = list(outputs[nd + nparams : schema.hidden_leaves])
        post = (
            device.roots(params_after),
            device.roots(opt_after),
            device.project(params_after),
            device.project(deltas),
            (
                leaf_specs(traced.param_paths, params_after),
                leaf_specs(traced.opt_paths, opt_after),
            ),
        )
        computed = None
        spec = traced.update
        if spec is not None:
            start = schema.hidden_leaves + 1
            values = list(outputs[start : start + len(traced.computed_names)])
            # The gradient probe row: zeros for a parameter without a gradient.
            by_position = dict(zip(spec.grads, values, strict=False))
            grads = [
                by_position[j] if j in by_position else device.zeros(p)
                for j, p in enumerate(params_after)
            ]
            computed = (
                device.roots(values),
                leaf_specs(traced.computed_names, values),
                device.project(grads),
            )
        step = _DeviceStep(self, program, index, policy, outputs, snapshot, pre, post, computed)
        self.runtime.submit(admission, step)
        return result

    def _resolve(self, program: _Program, state: list[Any]) -> DeviceCommitter | None:
        """Decide, at the first step, where this run's commitments are computed."""
        if self._path is not None:
            return self._device
        wanted = self.config.commitments
        traced = program.traced
        paths = [*traced.param_paths, *traced.opt_paths]
        arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
        unsupported = DeviceCommitter.unsupported(paths, arrays)
        processes = jax.process_count()
        devices = {d for x in arrays for d in x.devices()}
        platforms = {d.platform for d in devices}
        # zkdv.jax.scan returns its updates' states stacked; they are hashed on the host.
        scan = traced.registration.scan is not None
        if wanted == "device":
            if scan:
                raise ZKDVError(_messages.SCAN_DEVICE)
            if processes > 1:
                raise ZKDVError(_messages.DEVICE_MULTI_PROCESS.format(count=processes))
            if unsupported:
                raise ZKDVError(_messages.DEVICE_DTYPES.format(leaves=", ".join(unsupported[:4])))
        elif wanted == "auto":
            # Native BLAKE3 on every core beats XLA's CPU code; on an accelerator the
            # state would otherwise cross PCIe every step.
            accelerated = bool(platforms) and "cpu" not in platforms
            wanted = (
                "device"
                if accelerated and processes == 1 and not unsupported and not scan
                else "host"
            )
        self._path = wanted
        if wanted == "device":
            backend = "cpu" if "cpu" in platforms else "/".join(sorted(platforms))
            self._device = DeviceCommitter(
                self.config.chunk_bytes, self._log, default_schedule(backend, len(devices))
            )
        return self._device

    def _snapshot_copy(self, index: int, state: list[Any]) -> list[Any]:
        """Launch the asynchronous host copy of a replay snapshot (before donation)."""
        self._log.add(index, "snapshot", sum(_nbytes(x) for x in state))
        pool = self._pool
        if pool is None and jax.process_count() == 1:
            arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
            shardings = host_shardings(arrays)
            if shardings is not None:
                pool = self._pool = SnapshotPool(arrays, shardings)
        if pool is None:
            return [_to_host(leaf) for leaf in state]
        copied = pool.copy([x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state])
        with self._store_lock:
            self._slots[index] = copied
            self._slot_pending[index] = 2  # still needed for replay; file not written
        return copied

    def _snapshot_done(self, index: int) -> None:
        """The snapshot file of ``index`` is written (or not kept): one use less."""
        with self._store_lock:
            self._release_slot(index)

    def _release_slot(self, index: int) -> None:
        # Called under _store_lock.
        if index not in self._slots:
            return
        self._slot_pending[index] -= 1
        if self._slot_pending[index] > 0:
            return
        del self._slot_pending[index]
        arrays = self._slots.pop(index)
        if self._pool is not None:
            self._pool.release(arrays)

    def _keep_batch(self, index: int, batch: np.ndarray) -> None:
        with self._store_lock:
            self._batches[index] = batch

    def _verify_continuity(
        self, index: int, host_pre: tuple[list[np.ndarray], list[np.ndarray]]
    ) -> None:
        core = self.runtime.core
        assert core is not None and core.last_roots is not None
        traced = self._program_owner.traced if self._program_owner else None
        assert traced is not None
        params = core.commit(list(zip(traced.param_paths, host_pre[0], strict=True)))
        opt = core.commit(list(zip(traced.opt_paths, host_pre[1], strict=True)))
        self._check_continuity(index, params.root, opt.root)

    def _check_continuity(self, index: int, params: bytes, opt: bytes) -> None:
        core = self.runtime.core
        assert core is not None and core.last_roots is not None
        if params != core.last_roots.params:
            raise ZKDVVerificationError(
                _messages.MODIFIED_OUTSIDE.format(tree="parameters", step=index, previous=index - 1)
            )
        if opt != core.last_roots.opt_state:
            raise ZKDVVerificationError(
                _messages.MODIFIED_OUTSIDE.format(
                    tree="optimizer state", step=index, previous=index - 1
                )
            )

    def _expect_check(self, step: int) -> None:
        with self._store_lock:
            self._checks_pending.add(step)

    def _committed(self, index: int) -> None:
        with self._store_lock:
            self._committed_through = max(self._committed_through, index)
            self._collect()

    def _retired(self, index: int) -> None:
        with self._store_lock:
            self._checks_pending.discard(index)
            self._collect()

    def _collect(self) -> None:
        # A window [s, next) of snapshot s is dropped once all its steps are committed
        # and none of them awaits a check: a check completes asynchronously and must
        # replay from the snapshot that precedes its step, even if newer ones exist.
        steps = sorted(self._snapshots)
        for start, following in itertools.pairwise(steps):
            if self._committed_through < following - 1:
                break
            if any(start <= step < following for step in self._checks_pending):
                continue
            del self._snapshots[start]
            self._release_slot(start)
            for step in range(start, following):
                self._batches.pop(step, None)

    def _replay(self, challenge: Challenge, committed_post: float | None = None) -> ReplayOutcome:
        """Replay the challenged step from the snapshot before it.

        ``committed_post`` is the committed post-update value of a step whose apply
        program wrote over its pre-update parameters: its committed update is formed
        against the replayed pre-update value, as its delta probes were.
        """
        interval = self.replay_snapshot_interval
        start = challenge.step - challenge.step % interval
        with self._store_lock:
            params, opt = self._snapshots[start]
            batches = [self._batches[step] for step in range(start, challenge.step + 1)]
        artifact = self._artifact
        assert artifact is not None
        params, opt = jax.device_get((list(params), list(opt)))
        params, opt = artifact.advance(
            [np.asarray(leaf) for leaf in params], [np.asarray(leaf) for leaf in opt], batches[:-1]
        )
        delta, state = artifact.check(
            params, opt, batches[-1], challenge.param_index, challenge.state_index
        )
        committed = None
        if committed_post is not None:
            before = _select([np.asarray(leaf) for leaf in params], challenge.param_index)
            committed = float(np.float32(committed_post) - np.float32(before))
        return ReplayOutcome(delta, state, start, challenge.step - start, committed)
