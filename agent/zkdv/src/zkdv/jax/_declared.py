"""``Transaction.update(..., grads=, tx=)``: a user's own update declared as an Optax one.

A step whose update is its own code can still commit its gradient: it declares, beside
the post-update state it computed, the gradient and the Optax transformation the update
is. Inside a ``proof.jit`` production trace :func:`declare` records that transformation
applied to the gradient, on the transaction's own parameters and optimizer state, as
``Transaction.apply`` does (:class:`zkdv.jax._optimizer.Capture`), and binds the
declared post-update values to it. The step then runs as every step that commits its
gradient (``docs/jax.md``, "One program"): its post-update state is the declared
transformation's update evaluated canonically from the committed gradient, and the
values the function returns in place of the declared ones are that state. So what the
lab trains on is the declared transformation's update, and the platform replays it bit
for bit on any hardware; the user's own update computes nothing the step keeps, and XLA
removes it.

The SDK does not compare the values of the user's own update with the declared
transformation's: the state is the declared one by construction, and reading such a
comparison back every step would cost a device-to-host synchronisation. What it checks,
at the first call and at no cost per step, is the structure: the gradient has the
parameters', the transformation's state the declared ``opt_state``'s. A transcript whose
post-update state is not the declared transformation's (a modified SDK) is rejected by
the platform's replay at that step's record, naming the committed root and the
parameter whose probes differ.
"""

from __future__ import annotations

from typing import Any

import jax

from zkdv.errors import ZKDVError
from zkdv.jax import _context, _messages, _optimizer

__all__ = ["GRADS_AND_TX", "declare"]

GRADS_AND_TX = (
    "transaction.update(grads=, tx=) declares the update as the Optax transformation tx "
    "applied to the gradient grads: pass both or neither (a gradient without its "
    "transformation cannot be committed yet; a transformation without the gradient has "
    "nothing to apply)"
)
DECLARED_GRADIENT = (
    "transaction.update(grads=): the gradient has the structure {got}, the transaction's "
    "params {want}: the declared transformation updates every parameter of the "
    "transaction, so the gradient has their structure"
)
DECLARED_STATE = (
    "transaction.update(tx=): the declared transformation's optimizer state has the "
    "structure {got}, but opt_state= has {want}: declare the "
    "transformation that produced the transaction's opt_state (the one whose init built it)"
)


def declare(
    registration: _context.Registration,
    tx: Any,
    grads: Any,
    transaction: Any,
    declared: tuple[Any, Any, Any],
) -> None:
    """Record ``tx`` applied to ``grads`` as the update ``declared`` is (module docstring).

    Args:
        registration: the trace's registration of ``transaction``.
        tx: the declared ``optax.GradientTransformation`` (wrapped or not).
        grads: the declared gradient (traced).
        transaction: the :class:`~zkdv.jax.Transaction` (its pre-update ``params`` and
            ``opt_state``).
        declared: the ``deltas``, ``params`` and ``opt_state`` the user computed.

    Raises:
        ZKDVError: the gradient or the transformation's state has another structure
            than the parameters or the declared ``opt_state``, or the step already
            applied an optimizer.
    """
    wrapped = _optimizer.optimizer(tx)  # a TypeError for what is no transformation
    context = _context.current()
    capture: _optimizer.Capture | None = None if context is None else context.capture
    if capture is None:
        # A run that commits no gradient: the declared values are the update, judged
        # whole by the probes' tolerance (proof.attest).
        return
    if capture.recorded is not None:
        raise ZKDVError(_messages.TWO_UPDATES)
    deltas, params, opt_state = declared
    got: Any = jax.tree.structure(grads)
    want: Any = jax.tree.structure(transaction.params)
    if got != want:
        raise ZKDVError(DECLARED_GRADIENT.format(got=got, want=want))
    # The state the declared transformation would build, before its update reads ours.
    got = jax.tree.structure(jax.eval_shape(wrapped.inner.init, transaction.params))
    want = jax.tree.structure(opt_state)
    if got != want:
        raise ZKDVError(DECLARED_STATE.format(got=got, want=want))
    capture.update(wrapped.inner, grads, transaction.opt_state, transaction.params, {})
    recorded = _recorded(capture)
    # The declared values stand for the transformation's: the apply program computes
    # them from the committed gradient, and the step returns its values in their place.
    recorded.updates = deltas
    recorded.new_state = opt_state
    recorded.new_params = params
    registration.recorded = recorded


def _recorded(capture: _optimizer.Capture) -> _optimizer.Recorded:
    """What ``capture.update`` just recorded."""
    recorded = capture.recorded
    assert recorded is not None
    return recorded
