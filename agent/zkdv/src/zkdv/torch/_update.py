"""``optimizer.step()`` inside a Torch transaction: the update and what it commits.

The prepared optimizer (:mod:`zkdv.torch._prepared`) and a prepared GradScaler
(:mod:`zkdv.torch._scaler`) hand their step to :func:`step` and
:func:`skipped_by_scaler`. On the owner (rank 0) the step first waits at the mutation
barrier for the previous commitment, copies the pre-state a check needs (a replay
snapshot, or the rows the probes read) and fixes the step's dynamic options; then it
applies the canonical update of a copy of the gradients (:mod:`zkdv.gradients`), or
``torch.optim``'s own step where the update is not canonical. These functions act on the
driver's state through :class:`UpdateHost`, what they need of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from zkdv.errors import ZKDVError
from zkdv.torch._checkpoint import StepInputs
from zkdv.torch._eager import EagerHost, EagerTransaction, current_transaction
from zkdv.torch._model import full

if TYPE_CHECKING:
    from zkdv.torch._checkpoint import ReplayCheckpoint
    from zkdv.torch._model import PreparedModel
    from zkdv.torch.optimizers.bridge import OptimizerBridge

__all__ = ["Prepared", "UpdateHost", "skipped_by_scaler", "step"]

FSDP_NO_STATES = (
    "ZKDV under FSDP2 lost the gathered optimizer state of the step before snapshot "
    "step {step}; the snapshot cannot be taken"
)
TWO_STEPS = "a ZKDV transaction may call optimizer.step() only once"
NO_GRADIENT = (
    "parameter {name} has no gradient at step {step}, but the sealed attested step computes "
    "one for it; every step must differentiate the same parameters"
)
FROZEN_CHANGED = (
    "parameters that require gradients changed after attestation ({names}); the attested "
    "program differentiates exactly the parameters that required gradients when it was "
    "sealed, so create a new proof for the new set of trained parameters"
)


class Prepared(Protocol):
    """A prepared optimizer as its step sees it (``PreparedOptimizer``)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def bridge(self) -> OptimizerBridge: ...


class UpdateHost(EagerHost, Protocol):
    """What an optimizer step needs from the driver (:class:`zkdv.torch.ZKDV`): beside a
    transaction's needs, whether this rank follows, the prepared optimizer, the replay
    checkpoint, FSDP2's gathered states, the probes' row index, and which parameters
    train and were sealed with gradients. Stated here so that this module does not
    import the driver."""

    _probe_index: list[torch.Tensor | None] | None
    _full_states: list[dict[str, Any]] | None

    @property
    def follower(self) -> bool: ...

    @property
    def _prepared_optimizer(self) -> Prepared | None: ...

    @property
    def _checkpoint(self) -> ReplayCheckpoint | None: ...

    @property
    def _fsdp(self) -> bool: ...

    @property
    def _requires_grad(self) -> tuple[bool, ...] | None: ...


class _StepDroppedError(Exception):
    """Under DDP, a poisoned owner finishes the step natively and reports at the next entry."""


def _global_pre_hooks() -> dict[Any, Any]:
    """``torch.optim``'s global optimizer-step pre-hooks (``register_optimizer_step_pre_hook``)."""
    from torch.optim import optimizer as module

    return module._global_optimizer_pre_hooks


def _global_post_hooks() -> dict[Any, Any]:
    """``torch.optim``'s global optimizer-step post-hooks."""
    from torch.optim import optimizer as module

    return module._global_optimizer_post_hooks


def step(
    proof: UpdateHost,
    transaction: EagerTransaction,
    optimizer: Prepared,
    closure: Callable[[], float] | None,
) -> Any:
    """``optimizer.step()`` of the prepared optimizer inside ``transaction``.

    Raises:
        RuntimeError: another optimizer, a second step, or a change of which parameters
            require gradients since sealing.
    """
    if optimizer is not proof._prepared_optimizer:
        raise RuntimeError("the transaction stepped an optimizer this proof did not prepare")
    if transaction.stepped:
        raise RuntimeError(TWO_STEPS)
    optimizer.bridge.validate_configuration()
    model = proof._require_prepared_model()
    _validate_frozen(proof, model)
    # FSDP2: every rank gathers the live pre-update parameters (the probes' and the
    # snapshot's pre-state), so a shard changed between steps is seen as in one process.
    parameters = model.full_parameters()
    canonical = optimizer.bridge.canonical
    if not proof.follower:
        # The options are read after the step's pre-hooks on the canonical path.
        _before_update(proof, transaction, optimizer, parameters, options=not canonical)
    if canonical:
        result = _canonical_step(proof, transaction, optimizer, closure)
    else:
        # FSDP2: every rank takes part in gathering the gradients.
        if proof._fsdp or not proof.follower:
            gradients = _step_gradients(proof, transaction.index)
            if not proof.follower and not transaction.dropped:
                transaction.gradients = gradients
        result = optimizer.optimizer.step(closure)
    transaction.stepped = True
    return result


def _canonical_step(
    proof: UpdateHost,
    transaction: EagerTransaction,
    optimizer: Prepared,
    closure: Callable[[], float] | None,
) -> Any:
    """``optimizer.step()`` as the canonical update of the step's gradient.

    What ``torch.optim.Optimizer.step`` does around the update is kept: the closure,
    the global and the optimizer's own step hooks. The options are read after the
    pre-hooks, so what a hook sets is what the step commits and applies; the
    gradients the update reads are copied first and committed as they were read.
    """
    native = optimizer.optimizer
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    arguments: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    for hook in (*_global_pre_hooks().values(), *native._optimizer_step_pre_hooks.values()):
        changed = hook(native, arguments, keywords)
        if changed is not None:
            arguments, keywords = changed
    bridge = optimizer.bridge
    hyperparameters = bridge.hyperparameters()
    model = proof._require_prepared_model()
    if proof.follower and not proof._fsdp:
        gradients = [
            parameter.grad if held else None
            for parameter, held in zip(model.state_parameters, bridge.held, strict=True)
        ]
    else:
        # FSDP2: every rank gathers the full gradients (collectives in canonical order).
        gradients = _step_gradients(proof, transaction.index)
        if not proof.follower and not transaction.dropped:
            _commit_options(proof, transaction, hyperparameters)
            transaction.gradients = gradients
    if proof._fsdp:
        # Each rank's shards, from its own shard of the gradient: the canonical update is
        # elementwise, so the bits are those of the full update of the gathered gradient.
        trained = [gradient is not None for gradient in gradients]
        bridge.update_shards(trained, hyperparameters)
    else:
        bridge.update_live(gradients, hyperparameters)
    for hook in (*native._optimizer_step_post_hooks.values(), *_global_post_hooks().values()):
        hook(native, arguments, keywords)
    return loss


def _step_gradients(proof: UpdateHost, index: int) -> list[torch.Tensor | None]:
    """Copies of the gradients this step's update reads (None: not trained).

    The committed gradient is what the optimizer read, after accumulation, clipping
    and unscaling: copied now, since ``zero_grad(set_to_none=False)`` or the next
    backward pass may write into the same tensors while the commitment is pending.
    Under FSDP2 the copy is the full gradient, all-gathered from the reduce-scattered
    shards (a collective on every rank, in canonical parameter order).

    Raises:
        RuntimeError: a parameter the sealed program computes a gradient for has
            none at this step.
    """
    model = proof._require_prepared_model()
    trained = proof._trained
    assert trained is not None, "the program is sealed before the first update"
    out: list[torch.Tensor | None] = []
    with torch.no_grad():
        for name, parameter, train in zip(
            model.parameter_names, model.state_parameters, trained, strict=True
        ):
            if not train:
                out.append(None)
                continue
            gradient = parameter.grad
            if gradient is None:
                raise RuntimeError(NO_GRADIENT.format(name=name, step=index))
            out.append(
                full(gradient) if isinstance(gradient, DTensor) else gradient.detach().clone()
            )
    return out


def _commit_options(
    proof: UpdateHost, transaction: EagerTransaction, hyperparameters: list[dict[str, Any]]
) -> None:
    """Fix the step's dynamic options: committed, and replayed with it."""
    transaction.hyperparameters = hyperparameters
    assert proof._checkpoint is not None and transaction.words is not None
    proof._checkpoint.keep_inputs(
        transaction.index, StepInputs(transaction.words, transaction.hyperparameters)
    )


def skipped_by_scaler(proof: UpdateHost, optimizer: Any) -> None:
    """After a prepared GradScaler's step: one it skipped (an overflow) still counts.

    Its transaction commits the step with the parameters and optimizer state
    unchanged, and the scaler's state as its update leaves it.
    """
    transaction = current_transaction()
    if transaction is None or transaction.proof is not proof or transaction.stepped:
        return
    prepared = proof._prepared_optimizer
    if prepared is None or optimizer is not prepared:
        raise RuntimeError("the transaction stepped an optimizer this proof did not prepare")
    prepared.bridge.validate_configuration()
    model = proof._require_prepared_model()
    _validate_frozen(proof, model)
    if not proof.follower:
        _before_update(proof, transaction, prepared, model.full_parameters())
        if not transaction.dropped:
            # The overflowed gradient: a replay skips the update because of it.
            transaction.gradients = _step_gradients(proof, transaction.index)
    transaction.stepped = True


def _before_update(
    proof: UpdateHost,
    transaction: EagerTransaction,
    optimizer: Prepared,
    parameters: tuple[torch.Tensor, ...],
    *,
    options: bool = True,
) -> None:
    """Owner: wait for the previous commitment, copy the pre-state, fix the options.

    Args:
        options: fix the step's dynamic options now (the canonical step fixes them
            after the optimizer's pre-hooks instead).
    """
    try:
        # The previous step's commitment may still be hashing the live state.
        _wait_released(proof)
        if proof.runtime.snapshot_due(transaction.index):
            assert proof._checkpoint is not None
            transaction.snapshot = proof._checkpoint.take(
                transaction.index,
                parameters,
                _pre_states(proof, transaction.index),
                transaction.buffers_before,
                functools.partial(_poison_check, proof),
            )
        committer = proof._device_committer
        if committer is not None:
            # On the device: the rows the probes read, before the update overwrites them.
            transaction.pre_rows = committer.select(parameters)
        elif transaction.snapshot is None:
            transaction.pre_rows = _probe_rows(proof, parameters)
        if options:
            _commit_options(proof, transaction, optimizer.bridge.hyperparameters())
    except _StepDroppedError:
        transaction.dropped = True


def _validate_frozen(proof: UpdateHost, model: PreparedModel) -> None:
    """Refuse a change of which parameters require gradients since sealing."""
    sealed = proof._requires_grad
    if sealed is None:
        return
    now = tuple(parameter.requires_grad for parameter in model.state_parameters)
    if now != sealed:
        names = ", ".join(
            f"{name}: {before} -> {after}"
            for name, before, after in zip(model.parameter_names, sealed, now, strict=True)
            if before != after
        )
        raise RuntimeError(FROZEN_CHANGED.format(names=names))


def _pre_states(proof: UpdateHost, index: int) -> list[dict[str, Any]]:
    """The optimizer state before step ``index`` (rank 0, at the optimizer step).

    Under FSDP2 it is the full state gathered at the previous step's end: the
    optimizer state only changes inside ``optimizer.step()``, and gathering it again
    here would cost a second all-gather of the state on every rank.
    """
    if not proof._fsdp:
        return proof._bridge().live_states()
    states = proof._full_states
    if states is None:
        raise ZKDVError(FSDP_NO_STATES.format(step=index))
    proof._full_states = None
    return states


def _probe_rows(proof: UpdateHost, parameters: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Copies of the pre-update rows the probes read (at most 64 rows per leaf)."""
    core = proof.runtime.core
    # The probe set exists: step 0 is a snapshot step, and the barrier waited for
    # the previous commitment, which opened the transcript.
    assert core is not None and core.probes is not None
    probes = core.probes
    if proof._probe_index is None:
        # Index tensors on each parameter's device, built once: indexing a tensor
        # with a numpy array converts the array on every call.
        proof._probe_index = [
            None if rows is None else torch.from_numpy(rows).to(parameter.device)
            for rows, parameter in zip(probes.rows, parameters, strict=True)
        ]
    out = []
    with torch.no_grad():
        for parameter, index, shape in zip(
            parameters, proof._probe_index, probes.row_shapes, strict=True
        ):
            matrix = parameter.reshape(shape)
            out.append(matrix.clone() if index is None else matrix.index_select(0, index))
    return out


def _poison_check(proof: UpdateHost) -> None:
    runtime = proof.runtime
    if not runtime.multi_process:
        runtime.check()
    elif runtime.poisoned is not None:
        raise _StepDroppedError


def _wait_released(proof: UpdateHost) -> None:
    runtime = proof.runtime
    if not runtime.multi_process:
        runtime.barrier()
        return
    # Under DDP a failure is reported to every rank at the next entry; here the step
    # only stops waiting (a poisoned pipeline skips the commitment it waits for).
    if not runtime.barrier(raise_poison=False):
        raise _StepDroppedError
