"""The Torch driver: ``zkdv.torch.ZKDV``.

The public API is documented in ``docs/torch.md`` and in the Torch quick start. This
module wires the eager objects (:mod:`zkdv.torch._prepared`, :mod:`zkdv.torch._eager`)
to the shared :class:`~zkdv.driver.Driver` pipeline through its
:class:`~zkdv.driver.protocol.Runtime`, seals the attested program on the first
transaction (:mod:`zkdv.torch._sealing`, :mod:`zkdv.torch._lowering`) and answers
sampled checks by replaying from snapshots (:mod:`zkdv.torch._pipeline`). What
``optimizer.step()`` does inside a transaction is :mod:`zkdv.torch._update`; a step's
computed values, named and read back, are :mod:`zkdv.torch._computed`.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from zkdv.config import GradientBounds, ZKDVConfig
from zkdv.driver import Driver, ReplayOutcome
from zkdv.errors import ZKDVError, ZKDVPoisonedError
from zkdv.sampling import Challenge
from zkdv.torch import _artifact, _rng
from zkdv.torch._arrays import HostViews
from zkdv.torch._capture import current_capture
from zkdv.torch._checkpoint import ReplayCheckpoint
from zkdv.torch._computed import committed_values, computed_leaves
from zkdv.torch._device import DeviceCommitter
from zkdv.torch._device_merkle import leaf_spec
from zkdv.torch._eager import EagerTransaction, Layout, TorchStep
from zkdv.torch._lowering import LoweredProgram, count_flops
from zkdv.torch._model import UNPREPARED_MODEL, PreparedModel
from zkdv.torch._packing import BatchLayout
from zkdv.torch._pipeline import Pipeline
from zkdv.torch._prepared import PreparedOptimizer
from zkdv.torch._scaler import PreparedGradScaler
from zkdv.torch._sealing import CUDA_NONDETERMINISTIC, environment, gradient_program, trace
from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.bridge import OptimizerBridge
from zkdv.torch.optimizers.registry import OptimizerRegistry
from zkdv.transfers import TransferLog

__all__ = ["PROGRAM_KIND_ENV", "ZKDV"]

#: Environment override of the sealed program kind: ``aot-inductor`` (default) or
#: ``torch.export`` (no native compilation; for tests and quick iteration).
PROGRAM_KIND_ENV = "ZKDV_TORCH_PROGRAM"

NOT_ATTESTED = (
    "proof.transaction() replays sampled steps with the attested step function; "
    "decorate it with @proof.attest before the first transaction"
)
NO_MODEL = "ZKDV has no prepared model; pass the root module through proof.prepare() first"
NO_OPTIMIZER = "ZKDV has no prepared optimizer; pass it through proof.prepare() first"
NO_STEP = "a ZKDV transaction must call optimizer.step() on the prepared optimizer exactly once"


#: HostControl key of rank 0's sealing outcome (the first transaction only).
SEALED = "zkdv.sealed"
#: HostControl key of the committed run seed (the first transaction only).
RUN_SEED = "zkdv.rng"
#: HostControl key of which parameters train (FSDP2: every rank gathers their gradients).
TRAINED = "zkdv.trained"
DEVICE_PATH_SINGLE_PROCESS = (
    "ZKDVConfig(commitments='device') needs a single-process run without FSDP2: "
    "commitments of a multi-process run are computed by rank 0 from the whole state"
)
SETTINGS_CHANGED = (
    "this step would run under other settings than the sealed attested program, so its "
    "replay would compute something else: {what}. Keep the settings of the first "
    "transaction for the whole run"
)


@dataclass(frozen=True)
class _FirstState:
    """What every rank gathered on the first transaction (FSDP2: the full state)."""

    parameters: tuple[torch.Tensor, ...] | None = None
    states: list[dict[str, Any]] | None = None


STEP_ABORTED = (
    "a ZKDV transaction raised after optimizer.step(); its update changed the state "
    "without a commitment, so the transcript cannot continue"
)


class ZKDV(Driver):
    """Generate a verification tape around ordinary Torch training steps.

    Args:
        path: the proof directory (``records.cborl``, the program artifact, snapshot
            and batch files).
        config: run configuration; defaults to ``zkdv.ZKDVConfig()``.
        max_in_flight: the most unresolved transactions (commitments and checks).
        replay_snapshot_interval: a full pre-state snapshot every N steps; a sampled
            check replays at most N - 1 transitions before the challenged one.
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
            backend="torch",
            annotation=torch.profiler.record_function,
            max_in_flight=max_in_flight,
            replay_snapshot_interval=replay_snapshot_interval,
        )
        self._attested_function: Callable[..., Any] | None = None
        self._lowered_program: LoweredProgram | None = None
        self._prepared_model: PreparedModel | None = None
        self._prepared_optimizer: PreparedOptimizer | None = None
        self._prepared_scaler: PreparedGradScaler | None = None
        self._optimizer_registry = OptimizerRegistry()
        self._prepared_compiled: Pipeline | None = None
        #: Sealed program kind; set before the first transaction to override.
        self.program_kind = os.environ.get(PROGRAM_KIND_ENV) or _artifact.TORCH_EXPORT
        #: Seconds the first transaction spent sealing the program (one-time cost).
        self.sealing_seconds = 0.0
        #: FLOPs of one rank's gradient program (Torch's FLOP counter), set at sealing.
        self._program_flops: float | None = None
        self._batch_layout: BatchLayout | None = None
        self._layout: Layout
        self._checkpoint: ReplayCheckpoint | None = None
        self._unresolved: set[int] = set()
        self._resolution = threading.Lock()
        self._probe_index: list[torch.Tensor | None] | None = None
        #: The commit stage's host views of the live parameters and optimizer state.
        self._host_views = HostViews()
        #: FSDP2: the full optimizer state gathered at the previous step's end (or at the
        #: first entry), kept on rank 0 only while the next step takes a replay snapshot.
        self._full_states: list[dict[str, Any]] | None = None
        self._opened = False
        #: The committed run seed of a program with random operators (every rank).
        self._run_seed: int | None = None
        #: Transactions opened on this rank (the step index, followers included).
        self._transactions = 0
        #: Per parameter, whether it required gradients when the program was sealed.
        self._requires_grad: tuple[bool, ...] | None = None
        #: Per parameter, whether the optimizer updates it from a committed gradient:
        #: held by the optimizer, requiring gradients and given one by the program.
        self._trained: tuple[bool, ...] | None = None
        #: Threads, matmul precision and train/eval flags when the program was sealed.
        self._sealed_settings: dict[str, Any] = {}
        #: Where commitments are computed ("host" or "device"), resolved at sealing.
        self._path: str | None = None
        self._device_committer: DeviceCommitter | None = None
        self._transfers = TransferLog()

    # --- public frontend API ------------------------------------------------------------
    def prepare(self, *values: Any) -> Any:
        """Prepare recognized stateful objects and leave all others unchanged.

        A module becomes the prepared root model (returned unchanged: its layout is
        bound inside the proof); an optimizer is returned as a
        :class:`~zkdv.torch._prepared.PreparedOptimizer`. Anything else is returned
        as is.

        Returns:
            The sole value for one argument, a tuple for several.

        Raises:
            ValueError: an optimizer without a functional contract (LBFGS, unknown
                subclasses), a differentiable step or tensor-valued options.
        """
        prepared = tuple(self._prepare(value) for value in values)
        return prepared[0] if len(prepared) == 1 else prepared

    def attest(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``function(model, optimizer, batch)`` as the attested step.

        It is the hermetic transition a sampled check replays: it must call
        ``proof.forward(model, ...)``, ``proof.backward(loss)`` and
        ``optimizer.step()``. The first transaction traces it once and seals an AOT
        Inductor artifact. The function is returned unchanged, so it also runs as
        ordinary eager code.
        """
        if self._pipeline_ready():
            raise ZKDVError("the attested program is fixed by the first transaction")
        self._attested_function = function
        return function

    def register_functional_optimizer(
        self,
        optimizer_type: type[torch.optim.Optimizer],
        contract: OptimizerContract,
    ) -> None:
        """Register a proof-local custom functional optimizer contract."""
        self._optimizer_registry.register(contract, optimizer_type)

    def forward(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Lower a prepared model call during attestation capture."""
        capture = current_capture()
        if capture is None:
            return model(*args, **kwargs)
        prepared = self._require_prepared_model()
        if model is not prepared.public:
            raise RuntimeError(UNPREPARED_MODEL)
        return prepared.call(args, kwargs)

    def backward(self, loss: torch.Tensor, gradient: Any = None) -> None:
        """Lower backward in attestation and use eager autograd in training."""
        capture = current_capture()
        if capture is not None:
            capture.backward(loss, gradient)
        else:
            torch.autograd.backward(loss, gradient)

    def transaction(self, *, batch: Any, overlap: Any = None) -> EagerTransaction:
        """Begin an eager transaction before the model forward mutates state.

        Args:
            batch: every dynamic input of the step (a pytree of tensors); it is
                copied into the committed batch on entry.
            overlap: the :mod:`zkdv.overlap` policy; ``UNCHECKED`` by default.
        """
        if overlap is None:
            from zkdv import overlap as overlap_policy

            overlap = overlap_policy.UNCHECKED
        return EagerTransaction(self, batch, overlap)

    @property
    def commitments(self) -> str | None:
        """Where this run's commitments are computed, ``"host"`` or ``"device"``: the
        resolved ``ZKDVConfig.commitments`` (None before the first transaction)."""
        return self._path

    @property
    def transfers(self) -> TransferLog:
        """Bytes read from the device to the host, per step and kind (``docs/torch.md``)."""
        return self._transfers

    # --- preparation --------------------------------------------------------------------
    def _prepare(self, value: Any) -> Any:
        if isinstance(value, PreparedGradScaler):
            if value.proof is not self:
                raise ValueError("this GradScaler was prepared by another ZKDV proof")
            return value
        if isinstance(value, torch.amp.GradScaler):
            return self._prepare_scaler(value)
        if isinstance(value, PreparedOptimizer):
            if value.proof is not self:
                raise ValueError("this optimizer was prepared by another ZKDV proof")
            return value
        if isinstance(value, nn.Module):
            if not any(True for _ in value.parameters()) and not any(True for _ in value.buffers()):
                return value  # a stateless module (an activation, a loss) passes through
            current = self._prepared_model
            if current is not None:
                if current.public is value:
                    return value
                raise ValueError(
                    "ZKDV prepares one root model per proof; compose additional stateful "
                    "modules under that root"
                )
            prepared = PreparedModel.bind(value)
            self._prepared_model = prepared
            self._bind()
            return value
        if isinstance(value, torch.optim.Optimizer):
            if self._prepared_optimizer is not None:
                if self._prepared_optimizer.optimizer is value:
                    return self._prepared_optimizer
                raise ValueError("ZKDV prepares one optimizer per proof")
            contract = self._optimizer_registry.resolve(value)
            bridge = OptimizerBridge(value, contract)
            self._prepared_optimizer = PreparedOptimizer(self, value, bridge)
            self._bind()
            return self._prepared_optimizer
        return value

    def _prepare_scaler(self, scaler: torch.amp.GradScaler) -> Any:
        """Commit a GradScaler's state and steps (an disabled one passes through)."""
        if not scaler.is_enabled():
            return scaler  # scale() and unscale_() do nothing; step() is the optimizer's
        if self._pipeline_ready():
            raise ZKDVError("the attested program is fixed by the first transaction")
        current = self._prepared_scaler
        if current is not None:
            if current.scaler is scaler:
                return current
            raise ValueError("ZKDV prepares one GradScaler per proof")
        model = self._prepared_model
        device = model.parameters[0].device if model is not None else torch.device(scaler._device)
        self._prepared_scaler = PreparedGradScaler(self, scaler, device)
        self._bind()
        return self._prepared_scaler

    def _bind(self) -> None:
        if self._prepared_model is not None and self._prepared_optimizer is not None:
            self._prepared_optimizer.bridge.bind(self._prepared_model.state_parameters)
        scaler = self._prepared_scaler
        if scaler is not None and self._prepared_optimizer is not None:
            self._prepared_optimizer.bridge.bind_scaler(scaler.live_state, scaler.options)

    def _require_prepared_model(self) -> PreparedModel:
        if self._prepared_model is None:
            raise RuntimeError(NO_MODEL)
        return self._prepared_model

    def _bridge(self) -> OptimizerBridge:
        if self._prepared_optimizer is None:
            raise RuntimeError(NO_OPTIMIZER)
        return self._prepared_optimizer.bridge

    def _pipeline_ready(self) -> bool:
        return self._prepared_compiled is not None

    # --- transactions -------------------------------------------------------------------
    def _open_prepared_transaction(self, transaction: EagerTransaction) -> Any:
        runtime = self.runtime
        runtime.check_started()
        self._require_prepared_model()
        self._bridge()
        if self._attested_function is None:
            raise RuntimeError(NOT_ATTESTED)
        if self._batch_layout is None:
            self._batch_layout = BatchLayout.of(
                transaction.batch, self.rolling_window, self.config.token_unit
            )
        if self.follower:
            runtime.agree(None)
            self._gather(self._batch_layout.pack(transaction.batch))
            if self._gather_first_state() is not None:
                self._await_sealing()
            self._seed_step(transaction, self._transactions)
            return None
        lowered = self._lowered_program
        if lowered is not None:
            self._check_settings()
        if lowered is not None and runtime.world_size == 1:
            # Before anything is committed: a batch the sealed program does not compute.
            lowered.guards.check(
                (
                    *self._require_prepared_model().parameters,
                    *transaction.buffers_before,
                    *self._batch_layout.tensor_leaves(transaction.batch),
                )
            )
        if not runtime.multi_process:
            admission = runtime.admit(transaction.overlap)
        else:
            agreed = runtime.agree(transaction.overlap)
            assert agreed is not None  # followers returned above
            admission = agreed
        try:
            transaction.index = self.steps
            # Copied now: the committed batch is what the step was given, even if the
            # caller mutates its tensors afterwards.
            words = self._gather(self._batch_layout.pack(transaction.batch))
            transaction.words = words
            self._transfers.add(transaction.index, "batch", words.nbytes)
            first = self._gather_first_state()
            if self._prepared_compiled is None:
                self._seal_everywhere(transaction, first)
            assert self._checkpoint is not None
            self._checkpoint.keep_batch(transaction.index, words)
        except BaseException:
            admission.cancel()
            raise
        transaction.admission = admission
        self._seed_step(transaction, transaction.index)
        return admission

    def _settings(self) -> dict[str, Any]:
        """What changes the bits the step computes, besides its inputs.

        The thread count (CPU reductions split by it), float32 matmul precision, and
        every module's training flag (dropout and BatchNorm behave otherwise in eval
        mode): all fixed by the sealed program and applied by every replay.
        """
        model = self._require_prepared_model()
        return {
            "threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "training": [module.training for module in model.target.modules()],
        }

    def _check_settings(self) -> None:
        """Refuse a step that would run under other settings than the sealed program.

        Raises:
            RuntimeError: :data:`SETTINGS_CHANGED`, naming the setting.
        """
        sealed = self._sealed_settings
        now = self._settings()
        for name, value in now.items():
            if value != sealed.get(name):
                if name == "training":
                    what = (
                        "the model is in eval mode; call model.train() after evaluating"
                        if not any(value)
                        else "a module's train/eval mode differs from sealing"
                    )
                else:
                    what = f"{name} is {value!r}, was {sealed.get(name)!r}"
                raise RuntimeError(SETTINGS_CHANGED.format(what=what))

    def _seed_step(self, transaction: EagerTransaction, index: int) -> None:
        """Give step ``index``'s random operators their committed seed (this rank's)."""
        self._transactions += 1
        if self._run_seed is None:
            return
        devices = {parameter.device for parameter in self._require_prepared_model().parameters}
        generators = _rng.StepGenerators(
            _rng.step_seed(self._run_seed, index, self.runtime.rank), devices
        )
        # Entered here, left when the transaction closes (EagerTransaction.__exit__).
        transaction.generators = generators.__enter__()

    @property
    def _fsdp(self) -> bool:
        return self._prepared_model is not None and self._prepared_model.fsdp

    def _gather_first_state(self) -> _FirstState | None:
        """On the first transaction: FSDP2's full parameters and optimizer state.

        Every rank takes part in the all-gathers; rank 0 seals the program on the full
        shapes and snapshots step 0's optimizer state from them. Returns None after the
        first transaction; on the first, the gathered state (empty without FSDP2).
        """
        if self._opened:
            return None
        self._opened = True
        if not self._fsdp:
            return _FirstState()
        parameters = self._require_prepared_model().full_parameters()
        states = self._bridge().full_states()
        self._full_states = None if self.follower else states
        return _FirstState(parameters, states)

    def _seal_everywhere(self, transaction: EagerTransaction, first: _FirstState | None) -> None:
        """Seal on rank 0 and tell every follower whether it worked.

        A follower that went on after rank 0 failed to seal would block in the step's
        first collective; instead it waits for the outcome and raises with rank 0's
        message, and every later transaction raises on every rank.
        """
        runtime = self.runtime
        announce = runtime.multi_process and first is not None
        try:
            self._seal(transaction, first)
        except BaseException as error:
            if announce:
                message = f"rank 0 could not seal the attested program: {error}"
                runtime.share_failure(message)
                runtime.exchange(SEALED, message)
            raise
        if announce:
            runtime.exchange(SEALED, None)
            runtime.exchange(RUN_SEED, self._run_seed)
            runtime.exchange(TRAINED, self._trained)

    def _await_sealing(self) -> None:
        """Follower, first transaction: wait for rank 0's sealing outcome."""
        runtime = self.runtime
        outcome = runtime.exchange(SEALED)
        if outcome is not None:
            runtime.share_failure(str(outcome))
            raise ZKDVPoisonedError(str(outcome))
        seed = runtime.exchange(RUN_SEED)
        self._run_seed = None if seed is None else int(seed)
        self._trained = tuple(bool(train) for train in runtime.exchange(TRAINED))

    def _gather(self, words: np.ndarray) -> np.ndarray:
        """Every rank's committed rows, concatenated in rank order (DDP)."""
        world_size = self.runtime.world_size
        if world_size == 1:
            return words
        import torch.distributed as distributed

        local = torch.from_numpy(words.view(np.int32))
        if distributed.get_backend() == "nccl":
            local = local.cuda()
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        distributed.all_gather(gathered, local)
        return np.concatenate([part.cpu().numpy().view(np.uint32) for part in gathered])

    def _close_prepared_transaction(self, transaction: EagerTransaction) -> None:
        if not transaction.stepped:
            if transaction.admission is not None:
                transaction.admission.cancel()
            raise RuntimeError(NO_STEP)
        model = self._require_prepared_model()
        # FSDP2: the committed post-update state, gathered on every rank before any rank
        # can leave (the owner's early returns below come after the collectives).
        parameters = model.full_parameters()
        states = self._bridge().full_states() if model.fsdp else None
        if self.follower:
            return
        runtime = self.runtime
        if states is not None and runtime.snapshot_due(transaction.index + 1):
            self._full_states = states
        if transaction.dropped or (runtime.multi_process and runtime.poisoned is not None):
            transaction.admission.cancel()
            return
        layout = self._batch_layout
        assert layout is not None
        tokens = layout.tokens * runtime.world_size
        # Every rank runs the same gradient program on its own rows: the counted FLOPs
        # times the world size. Without a count, the usual dense estimate: 6 FLOPs per
        # parameter per token (forward and backward), over every rank's tokens.
        flops = (
            self._program_flops * runtime.world_size
            if self._program_flops is not None
            else 6.0 * self._parameter_count * tokens
        )
        post_buffers = [buffer.clone() for buffer in model.buffers]
        device = None
        committer = self._device_committer
        if committer is not None and transaction.pre_rows is not None:
            # Dispatched now, on the training stream: they read the state before the next
            # step's in-place update, and only 32 bytes a leaf and the probes come back.
            bridge = self._bridge()
            names = self._layout
            state_leaves = bridge.leaves(bridge.live_states(), parameters)
            gradients = transaction.gradients
            computed = None
            if gradients is not None:
                computed = committer.roots(computed_leaves(self, gradients, post_buffers))
            device = (
                (
                    committer.roots(list(zip(names.parameter_names, parameters, strict=True))),
                    committer.roots(list(zip(names.state_paths, state_leaves, strict=True))),
                    committer.roots(list(zip(names.buffer_names, post_buffers, strict=True))),
                ),
                committer.probe(transaction.pre_rows, parameters, gradients),
                computed,
            )
        step = TorchStep(
            self,
            transaction,
            parameters=parameters,
            states=states,
            post_buffers=post_buffers,
            tokens=tokens,
            flops=flops,
            device=device,
        )
        with self._resolution:
            self._unresolved.add(transaction.index)
        try:
            runtime.submit(transaction.admission, step)
        except ZKDVPoisonedError:
            if not runtime.multi_process:
                raise
            transaction.admission.cancel()  # reported to every rank at the next entry

    def _abort_prepared_transaction(self, transaction: EagerTransaction) -> None:
        if transaction.admission is not None:
            transaction.admission.cancel()
        if transaction.stepped and not self.follower:
            self.runtime.poison(ZKDVError(STEP_ABORTED))

    def _retired(self, index: int) -> None:
        with self._resolution:
            self._unresolved.discard(index)
            oldest = min(self._unresolved, default=self.steps)
        if self._checkpoint is not None:
            self._checkpoint.prune(oldest)

    # --- sealing and replay -------------------------------------------------------------
    def _seal(
        self,
        transaction: EagerTransaction,
        first: _FirstState | None,
    ) -> None:
        """Trace and lower the attested step on rank 0 (FSDP2: ``first``'s full state)."""
        started = time.perf_counter()
        model = self._require_prepared_model()
        optimizer = self._prepared_optimizer
        assert optimizer is not None and self._attested_function is not None
        parameters, states = self._sealing_state(first)
        self._parameter_count = sum(parameter.numel() for parameter in parameters)
        lowered = self._trace(transaction, parameters, states)
        state_leaves = optimizer.bridge.leaves(states, parameters)
        self._layout = Layout(
            model.parameter_names,
            optimizer.bridge.leaf_paths(model.parameter_names),
            model.buffer_names,
            [parameter.numel() for parameter in parameters],
            [leaf.numel() for leaf in state_leaves],
        )
        device = parameters[0].device
        self._resolve_path(model, device, parameters)
        if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            warnings.warn(CUDA_NONDETERMINISTIC, RuntimeWarning, stacklevel=4)
        self._start_replays(lowered, parameters, state_leaves, device)
        self._commit_program(transaction, lowered, parameters, state_leaves, device)
        self.sealing_seconds = time.perf_counter() - started

    def _sealing_state(
        self, first: _FirstState | None
    ) -> tuple[tuple[torch.Tensor, ...], list[dict[str, Any]]]:
        """The parameters and optimizer state the program is sealed on (FSDP2: full)."""
        if first is not None and first.parameters is not None and first.states is not None:
            return first.parameters, first.states
        return self._require_prepared_model().parameters, self._bridge().live_states()

    def _trace(
        self,
        transaction: EagerTransaction,
        parameters: tuple[torch.Tensor, ...],
        states: list[dict[str, Any]],
    ) -> LoweredProgram:
        """Lower the attested step; fix what the sealed program depends on."""
        model = self._require_prepared_model()
        optimizer = self._prepared_optimizer
        layout = self._batch_layout
        assert optimizer is not None and self._attested_function is not None
        assert layout is not None
        function, unused = gradient_program(
            self._attested_function,
            model,
            optimizer,
            layout,
            parameters,
            world_size=self.runtime.world_size,
        )
        # Which parameters the sealed program differentiates (checked every step).
        self._requires_grad = tuple(p.requires_grad for p in model.state_parameters)
        lowered, arguments = trace(
            function,
            unused,
            model,
            optimizer,
            layout,
            transaction,
            parameters,
            states,
            kind=self.program_kind,
        )
        self._lowered_program = lowered
        self._trained = tuple(
            requires and held and not skip
            for requires, held, skip in zip(
                self._requires_grad, optimizer.bridge.held, lowered.unused, strict=True
            )
        )
        self._sealed_settings = self._settings()
        self._run_seed = _rng.run_seed() if lowered.program.random else None
        self._program_flops = count_flops(lowered.graph, arguments)
        return lowered

    def _start_replays(
        self,
        lowered: LoweredProgram,
        parameters: tuple[torch.Tensor, ...],
        state_leaves: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        """The snapshot store and the replay pipeline that answer sampled checks."""
        model = self._require_prepared_model()
        layout = self._batch_layout
        assert layout is not None
        runtime = self.runtime
        self._checkpoint = ReplayCheckpoint(
            self.replay_snapshot_interval,
            capacity=runtime.max_in_flight + 2,
            pinned=device.type == "cuda",
            files=runtime.keep_files,
        )
        self._prepared_compiled = Pipeline(
            lowered.program,
            lowered.unused,
            self._bridge(),
            layout,
            self._checkpoint,
            parameter_sizes=[parameter.numel() for parameter in parameters],
            state_sizes=[leaf.numel() for leaf in state_leaves],
            buffer_count=len(model.buffer_names),
            device=device,
            world_size=runtime.world_size,
            run_seed=self._run_seed,
            committed=functools.partial(committed_values, self),
        )

    def _commit_program(
        self,
        transaction: EagerTransaction,
        lowered: LoweredProgram,
        parameters: tuple[torch.Tensor, ...],
        state_leaves: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        """Commit the sealed program's bytes and the environment it replays in."""
        optimizer = self._prepared_optimizer
        layout = self._batch_layout
        assert optimizer is not None and layout is not None
        env = environment(
            model=self._require_prepared_model(),
            optimizer=optimizer,
            lowered=lowered,
            layout=layout,
            leaves=self._layout,
            parameters=parameters,
            state_leaves=state_leaves,
            buffers_before=transaction.buffers_before,
            device=device,
            world_size=self.runtime.world_size,
            run_seed=self._run_seed,
            program_flops=self._program_flops,
        )
        compiled = lowered.kind == _artifact.AOT_INDUCTOR
        bounds = GradientBounds.default(env["precision"]["kind"], compiled=compiled)
        self.runtime.set_program(lowered.kind, lowered.material, env=env, bounds=bounds)

    def _resolve_path(
        self, model: PreparedModel, device: torch.device, parameters: tuple[torch.Tensor, ...]
    ) -> None:
        """Decide where commitments are computed (``ZKDVConfig.commitments``).

        ``auto``: on the device when the parameters are on CUDA in a single-process,
        unsharded run (native BLAKE3 on every CPU core beats tensor code on a CPU);
        ``device`` forces it (a CPU run then hashes with tensor code: slow, for tests).

        Raises:
            ZKDVError: ``device`` asked for a multi-process or FSDP2 run.
        """
        wanted = self.config.commitments
        possible = self.runtime.world_size == 1 and not model.fsdp
        if wanted == "device" and not possible:
            raise ZKDVError(DEVICE_PATH_SINGLE_PROCESS)
        if wanted == "auto":
            wanted = "device" if device.type == "cuda" and possible else "host"
        self._path = wanted
        if wanted != "device":
            return
        core = self.runtime.core
        assert core is not None
        specs = tuple(
            leaf_spec(name, parameter)
            for name, parameter in zip(model.parameter_names, parameters, strict=True)
        )
        self._device_committer = DeviceCommitter(
            device, self.config.chunk_bytes, core.probe_set(specs), self._transfers
        )

    def _replay(self, challenge: Challenge, committed_post: float) -> ReplayOutcome:
        pipeline = self._prepared_compiled
        assert pipeline is not None
        return pipeline.replay(challenge, committed_post)
