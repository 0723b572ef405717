"""Committed gradients in the JAX frontend: the optimizer wrapper and the update it declares.

A ``proof.jit`` step that trains with Optax commits, at every step, the gradient the
optimizer receives and the state the forward pass writes (:mod:`zkdv.gradients`), and
applies the optimizer to that gradient canonically (:mod:`zkdv.jax.canonical`), so the
platform's replay, on any hardware, recomputes the gradient (compared within the run's
bounds) and then reproduces the committed post-update state bit for bit.

* :func:`optimizer` wraps an ``optax.GradientTransformation``. Inside a ``proof.jit``
  production trace its ``update`` records the gradient it receives (with the state and
  parameters it reads) into the trace's :class:`Capture`; anywhere else it is the inner
  update. ``zkdv.jax.contrib.TrainState`` wraps its ``tx``, Flax NNX's
  ``nnx.Optimizer`` is intercepted (:mod:`zkdv.jax._nnx`), and the explicit
  ``Transaction.apply`` wraps the ``tx`` it is given. :meth:`Capture.apply_updates`
  records the parameters ``optax.apply_updates`` gives.
* :func:`describe` turns what one trace recorded into an :class:`UpdateSpec`: which
  parameter and optimizer-state leaves the update reads and writes, which state leaves
  are step counters, and which are *carried*: written by the step otherwise than by the
  optimizer (Flax ``batch_stats``, NNX ``BatchStat``, RNG counts), whose post-update
  values are committed. Everything is found by object identity of the traced values,
  as the rest of the frontend binds its transaction.
* :func:`apply_function` is the committed ``apply`` program: ``(params, opt_state,
  computed values, zero) -> (params, opt_state)``: ``tx.update`` and
  ``optax.apply_updates`` (``p + u`` and the cast back to the parameter's dtype) on the
  committed values, evaluated with :func:`~zkdv.jax.canonical.canonical` and the
  program's runtime zero, the counters incremented, the carried values written.

The training step runs the apply program itself (``docs/jax.md``, "One program"): the
step's own program computes the gradient and the carried values (its copy of the
optimizer update is dead code that XLA removes), then the apply program computes the
post-update state from them. So the state the lab trains on *is* what the platform's
replay computes from the committed values, by construction, and the canonical update
is compiled once.

An update that has no canonical form (a matrix product inside the optimizer, as Muon's)
keeps the plain Optax evaluation, and the run still commits its gradient; the replay
then judges its post-update state by the probes' tolerance (the apply function's
``reason`` says why it is not canonical).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zkdv.errors import ZKDVError
from zkdv.jax import _context, _messages
from zkdv.jax.canonical import CANONICAL_VERSION, NotCanonical, canonical

__all__ = [
    "Capture",
    "CommittedOptimizer",
    "Recorded",
    "UpdateSpec",
    "apply_function",
    "deltas",
    "describe",
    "optimizer",
    "optimizer_env",
]


@dataclass(frozen=True)
class _Update:
    """The ``update`` of a :class:`CommittedOptimizer` (hashable: a static TrainState field)."""

    inner: optax.GradientTransformation

    def __call__(
        self, updates: Any, state: Any, params: Any = None, **extra: Any
    ) -> tuple[Any, Any]:
        context = _context.current()
        capture = None if context is None else context.capture
        if capture is None or context is None or context.mode not in ("production", "scan"):
            return _plain(self.inner, updates, state, params, extra)
        if context.nested():
            raise ZKDVError(_messages.NESTED_UPDATE)
        return capture.update(self.inner, updates, state, params, extra)  # type: ignore[no-any-return]


class CommittedOptimizer(optax.GradientTransformationExtraArgs):  # type: ignore[misc]
    """An Optax transformation whose updates ``proof.jit`` commits and applies canonically.

    Built by :func:`optimizer`; ``init`` is the inner one's, ``update`` records and
    canonicalises inside a ``proof.jit`` step and is the inner update elsewhere.
    """

    __slots__ = ()

    @property
    def inner(self) -> optax.GradientTransformation:
        """The wrapped transformation."""
        update = self.update
        assert isinstance(update, _Update)
        return update.inner


def optimizer(tx: optax.GradientTransformation) -> CommittedOptimizer:
    """Wrap ``tx`` so that a ``proof.jit`` step commits the gradient it receives.

    Inside a ``proof.jit`` step (single process, one device or sharded), ``update`` records
    the gradient, optimizer state and parameters it receives and evaluates ``tx.update``
    by the ``zkdv-jax-canonical-v2`` rules, the same bits on any hardware; where
    ``tx.update`` has no canonical form it is evaluated as usual and the gradient is
    committed all the same. Outside ``proof.jit`` (``jax.jit``, eager code) it is
    ``tx.update``. ``zkdv.jax.contrib.TrainState.create(proof=...)`` and
    ``Transaction.apply`` wrap their ``tx`` themselves; wrapping twice is a no-op.

    Args:
        tx: any ``optax.GradientTransformation`` (or an object with its ``init`` and
            ``update``, as ``optax.MultiSteps``).

    Returns:
        A ``GradientTransformationExtraArgs`` with ``tx``'s ``init``.
    """
    if isinstance(tx, CommittedOptimizer):
        return tx
    # Not only GradientTransformation instances: optax.MultiSteps has init and update too.
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"zkdv.jax.optimizer wraps an optax.GradientTransformation, got {type(tx).__name__}"
        )
    return CommittedOptimizer(tx.init, _Update(tx))


def inner(tx: Any) -> Any:
    """The transformation a (possibly wrapped) ``tx`` applies."""
    return tx.inner if isinstance(tx, CommittedOptimizer) else tx


def _plain(
    tx: optax.GradientTransformation, updates: Any, state: Any, params: Any, extra: dict[str, Any]
) -> tuple[Any, Any]:
    update: Any = tx.update
    if extra and not isinstance(tx, optax.GradientTransformationExtraArgs):
        update = optax.with_extra_args_support(tx).update
    new_updates, new_state = update(updates, state, params, **extra)
    return new_updates, new_state


@dataclass
class Recorded:
    """The one optimizer update a production trace recorded (traced values)."""

    tx: optax.GradientTransformation
    grads: Any
    state: Any
    params: Any
    updates: Any
    new_state: Any
    #: The parameters after ``apply_updates``, once applied.
    new_params: Any = None


@dataclass
class Capture:
    """What one production trace's optimizer update recorded; lives on its TraceContext.

    Args:
        zero: the program's runtime uint32 zero (an input), for the canonical fences.
    """

    zero: Any
    recorded: Recorded | None = None

    def update(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        state: Any,
        params: Any,
        extra: dict[str, Any],
    ) -> tuple[Any, Any]:
        """``tx.update(grads, state, params)``, recorded.

        Evaluated plainly: the step's post-update state is the apply program's (module
        docstring), so this copy matters only to values the step derives from it.
        """
        if self.recorded is not None:
            raise ZKDVError(_messages.TWO_UPDATES)
        if extra:
            raise ZKDVError(_messages.EXTRA_ARGUMENTS.format(names=sorted(extra)))
        updates, new_state = _plain(tx, grads, state, params, {})
        self.recorded = Recorded(tx, grads, state, params, updates, new_state)
        return updates, new_state

    def apply_updates(self, params: Any, updates: Any) -> Any:
        """``optax.apply_updates(params, updates)``, recorded."""
        result = optax.apply_updates(params, updates)
        if self.recorded is not None:
            self.recorded.new_params = result
        return result


def evaluate_update(
    tx: optax.GradientTransformation, zero: Any, grads: Any, state: Any, params: Any
) -> tuple[Any, Any, str | None]:
    """``tx.update`` by the canonical rules, or plainly with the reason it is not canonical."""

    def update(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        return _plain(tx, g, s, p, {})

    try:
        updates, new_state = canonical(update, zero)(grads, state, params)
    except NotCanonical as error:
        # Whatever the interpreter emitted before it stopped is dead code, removed by XLA.
        updates, new_state = update(grads, state, params)
        return updates, new_state, str(error)
    return updates, new_state, None


def apply_updates(params: Any, updates: Any, zero: Any) -> Any:
    """``optax.apply_updates``, canonical when ``zero`` (the runtime zero) is given."""
    if zero is None:
        return optax.apply_updates(params, updates)
    return canonical(optax.apply_updates, zero)(params, updates)


@dataclass(frozen=True)
class UpdateSpec:
    """Where one step's optimizer update sits in the transaction's flat state.

    Positions index the transaction's parameter leaves and its optimizer-state
    continuity leaves (``records.cborl`` schema order).

    Attributes:
        tx: the optimizer's own transformation (unwrapped).
        tx_params: parameter positions the optimizer updates, in its leaf order.
        tx_tree: the structure of the parameters (and gradients) the optimizer reads.
        overwritten: parameter positions replaced by their gradient (Flax's
            ``OVERWRITE_WITH_GRADIENT``).
        state: continuity positions of the optimizer's state, in its leaf order.
        state_tree: the structure of that state.
        counters: continuity positions incremented by one (``step``).
        carried: continuity positions the step writes otherwise (committed values).
        grads: parameter positions with a committed gradient, in schema order.
        weak: weak types of the apply program's inputs (params, continuity, computed).
    """

    tx: optax.GradientTransformation = field(compare=False)
    tx_params: tuple[int, ...]
    tx_tree: Any
    overwritten: tuple[int, ...]
    state: tuple[int, ...]
    state_tree: Any
    counters: tuple[int, ...]
    carried: tuple[int, ...]
    grads: tuple[int, ...]
    weak: tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]


def optimizer_env(reason: str | None) -> dict[str, Any]:
    """The root record's ``env.update``: whether the update is canonical, else why not.

    Not ``env.optimizer``, which names a Torch run's optimizer contract and groups (the
    platform infers a JAX run's optimizer from its state leaves).
    """
    env: dict[str, Any] = {"canonical": reason is None, "rules": CANONICAL_VERSION}
    if reason is not None:
        env["reason"] = reason
    return env


def _positions(leaves: Sequence[Any], among: Sequence[Any], what: str) -> tuple[int, ...]:
    index = {id(leaf): i for i, leaf in enumerate(among)}
    try:
        return tuple(index[id(leaf)] for leaf in leaves)
    except KeyError:
        raise ZKDVError(_messages.UPDATE_NOT_STATE.format(what=what)) from None


def _weak(leaves: Sequence[Any]) -> tuple[bool, ...]:
    return tuple(bool(getattr(jax.typeof(leaf), "weak_type", False)) for leaf in leaves)


def describe(
    recorded: Recorded,
    params_before: Sequence[Any],
    params_after: Sequence[Any],
    opt_before: Sequence[Any],
    opt_after: Sequence[Any],
    *,
    counters: Sequence[Any] = (),
    overwrite: Sequence[Any] = (),
) -> tuple[UpdateSpec, list[Any]]:
    """The update one production trace declared, and its computed values (traced).

    Args:
        recorded: the trace's recorded optimizer update.
        params_before, params_after: the transaction's parameter leaves.
        opt_before, opt_after: its optimizer-state continuity leaves.
        counters: pre-update leaves of step counters (incremented by one).
        overwrite: gradient leaves that replace parameters (``OVERWRITE_WITH_GRADIENT``).

    Returns:
        The spec, and the step's computed values: the gradient of each parameter in
        ``spec.grads``, then the post-update value of each carried leaf.

    Raises:
        ZKDVError: the update reads a value that is not the transaction's state, or the
            step writes a parameter otherwise than by the update.
    """
    if recorded.new_params is None:
        raise ZKDVError(_messages.UPDATE_NOT_APPLIED)
    tx_leaves = jax.tree.leaves(recorded.params)
    tx_params = _positions(tx_leaves, params_before, "parameters")
    grad_leaves = jax.tree.leaves(recorded.grads)
    new_params = jax.tree.leaves(recorded.new_params)
    if len(grad_leaves) != len(tx_leaves) or len(new_params) != len(tx_leaves):
        raise ZKDVError(_messages.GRADIENT_STRUCTURE)
    gradient, overwritten = _gradients(
        tx_params, grad_leaves, new_params, overwrite, params_before, params_after
    )
    _check_gradient_types(gradient, params_before)
    state = _state_positions(recorded, opt_before, opt_after)
    counter_positions = _positions(counters, opt_before, "step counter")
    fixed = set(state) | set(counter_positions)
    carried = tuple(
        p
        for p, (before, after) in enumerate(zip(opt_before, opt_after, strict=True))
        if p not in fixed and after is not before
    )
    grads = tuple(sorted(gradient))
    computed = [gradient[p] for p in grads] + [opt_after[p] for p in carried]
    spec = UpdateSpec(
        tx=recorded.tx,
        tx_params=tx_params,
        tx_tree=jax.tree.structure(recorded.params),
        overwritten=tuple(overwritten),
        state=state,
        state_tree=jax.tree.structure(recorded.state),
        counters=counter_positions,
        carried=carried,
        grads=grads,
        weak=(_weak(params_before), _weak(opt_before), _weak(computed)),
    )
    return spec, computed


def _gradients(
    tx_params: tuple[int, ...],
    grad_leaves: Sequence[Any],
    new_params: Sequence[Any],
    overwrite: Sequence[Any],
    params_before: Sequence[Any],
    params_after: Sequence[Any],
) -> tuple[dict[int, Any], list[int]]:
    """Each updated parameter's gradient by position, and the overwritten positions.

    A parameter the optimizer updates takes its gradient; one that the step replaced by
    a gradient leaf of ``overwrite`` takes that leaf. Any other written parameter fails.
    """
    gradient: dict[int, Any] = {}
    for position, grad, new in zip(tx_params, grad_leaves, new_params, strict=True):
        if params_after[position] is not new:
            raise ZKDVError(_messages.PARAMETER_WRITTEN)
        gradient[position] = grad
    overwrite_ids = {id(leaf) for leaf in overwrite}
    overwritten = []
    for position, (before, after) in enumerate(zip(params_before, params_after, strict=True)):
        if position in gradient:
            continue
        if id(after) in overwrite_ids:
            overwritten.append(position)
            gradient[position] = after
        elif after is not before:
            raise ZKDVError(_messages.PARAMETER_WRITTEN)
    return gradient, overwritten


def _check_gradient_types(gradient: dict[int, Any], params_before: Sequence[Any]) -> None:
    """Each gradient has its parameter's shape and dtype."""
    for position, grad in gradient.items():
        param = params_before[position]
        if jnp.shape(grad) != jnp.shape(param) or jnp.result_type(grad) != jnp.result_type(param):
            raise ZKDVError(
                _messages.GRADIENT_DTYPE.format(
                    got=f"{jnp.result_type(grad)}{list(jnp.shape(grad))}",
                    want=f"{jnp.result_type(param)}{list(jnp.shape(param))}",
                )
            )


def _state_positions(
    recorded: Recorded, opt_before: Sequence[Any], opt_after: Sequence[Any]
) -> tuple[int, ...]:
    """Where the optimizer's state sits in the continuity leaves; the step returns its update."""
    state = _positions(jax.tree.leaves(recorded.state), opt_before, "optimizer state")
    new_state = jax.tree.leaves(recorded.new_state)
    if len(new_state) != len(state) or any(
        opt_after[p] is not leaf for p, leaf in zip(state, new_state, strict=True)
    ):
        raise ZKDVError(_messages.STATE_NOT_RETURNED)
    return state


Apply = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]


def deltas(after: tuple[Any, ...], before: tuple[Any, ...]) -> tuple[Any, ...]:
    """The realized changes ``float32(after) - float32(before)`` (the delta probes').

    Its own program, after the apply program, where the step commits on the device (or
    another process holds the state; on the host the commit stage subtracts
    the probed rows): in the apply program XLA:CPU computed them at twice the cost of
    the whole canonical update (a 11.5M-parameter MLP: 92 ms against 44 ms for the
    update and 5 ms for this program after it).
    """
    return tuple(
        jnp.asarray(a).astype(jnp.float32) - jnp.asarray(b).astype(jnp.float32)
        for a, b in zip(after, before, strict=True)
    )


def apply_function(spec: UpdateSpec) -> tuple[Apply, list[str | None]]:
    """The committed ``apply`` program of ``spec`` (traceable, exported by the frontend).

    ``(params, opt_state, computed, zero) -> (params, opt_state)`` over flat tuples in
    schema order: the optimizer applied to the computed gradient by the canonical rules
    (:mod:`zkdv.jax.canonical`), the step counters incremented, the carried values
    written, every other leaf kept.

    Returns:
        The function, and a list that tracing it fills with one entry: None when the
        update is canonical, else why it is not (it is then evaluated plainly).
    """
    ngrads = len(spec.grads)
    grad_index = {position: k for k, position in enumerate(spec.grads)}
    outcome: list[str | None] = []

    def apply(
        params: tuple[Any, ...], opt_state: tuple[Any, ...], computed: tuple[Any, ...], zero: Any
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        grads, carried = computed[:ngrads], computed[ngrads:]
        tx_params = jax.tree.unflatten(spec.tx_tree, [params[p] for p in spec.tx_params])
        tx_grads = jax.tree.unflatten(spec.tx_tree, [grads[grad_index[p]] for p in spec.tx_params])
        state = jax.tree.unflatten(spec.state_tree, [opt_state[p] for p in spec.state])
        updates, new_state, reason = evaluate_update(spec.tx, zero, tx_grads, state, tx_params)
        outcome[:] = [reason]
        new_params = apply_updates(tx_params, updates, zero if reason is None else None)
        params_after = list(params)
        for position, value in zip(spec.tx_params, jax.tree.leaves(new_params), strict=True):
            params_after[position] = value
        for position in spec.overwritten:
            params_after[position] = grads[grad_index[position]]
        opt_after = list(opt_state)
        for position, value in zip(spec.state, jax.tree.leaves(new_state), strict=True):
            opt_after[position] = value
        for position in spec.counters:
            count = jnp.asarray(opt_state[position])
            opt_after[position] = count + jnp.ones((), count.dtype)
        for position, value in zip(spec.carried, carried, strict=True):
            opt_after[position] = value
        return tuple(params_after), tuple(opt_after)

    return apply, outcome
