"""``zkdv.jax.Transaction``: the explicit declaration of a ``proof.jit`` step's update.

It registers its values with the trace's :class:`~zkdv.jax._context.TraceContext`, and
:meth:`Transaction.apply` runs the optimizer through :func:`zkdv.jax.optimizer`, so it
sits above both.
"""

from __future__ import annotations

from typing import Any

import optax

from zkdv.errors import ZKDVError
from zkdv.jax import _declared, _messages, _optimizer
from zkdv.jax._context import UPDATE_TWICE, Registration, current
from zkdv.overlap import Policy

__all__ = ["Transaction"]


class Transaction:
    """Declare the one training transaction of a ``proof.jit`` function (explicit API).

    Construct it with the pre-update values, compute the real update normally, then
    call :meth:`update` with the results. Both calls are symbolic markers while JAX
    traces the function: they add no operations to the program and open no transcript
    transaction; the ``proof.jit`` wrapper opens exactly one per actual invocation.
    Outside ``proof.jit`` (plain ``jax.jit`` or eager code) they do nothing.

    Args:
        batch: the committed batch: an application-packed ``(rows, cols)`` uint32
            array, or any PyTree of arrays, packed losslessly (see ``docs/jax.md``).
        params: the pre-update parameters, a subtree of the function's inputs.
        opt_state: the pre-update optimizer state, a subtree of the function's inputs;
            it must not be donated.
        overlap: this transaction's overlap policy (``zkdv.overlap``); None means
            ``UNCHECKED`` unless the invocation passes a policy argument.
    """

    def __init__(
        self,
        *,
        batch: Any,
        params: Any,
        opt_state: Any,
        overlap: Policy | None = None,
    ) -> None:
        self.batch = batch
        self.params = params
        self.opt_state = opt_state
        self.overlap = None if overlap is None else Policy(overlap)
        self._registration: Registration | None = None
        context = current()
        if context is not None and context.mode == "scan":
            raise ZKDVError(_messages.SCAN_NOT_TRAIN_STATE)
        if context is not None and context.mode == "production":
            if context.nested():
                raise ZKDVError(_messages.NESTED_UPDATE)
            self._registration = Registration("transaction", params, opt_state, batch, self.overlap)
            context.open(self._registration)

    def apply(self, tx: Any, grads: Any) -> tuple[Any, Any]:
        """Apply the optimizer to the gradient and declare the update; commits the gradient.

        ``tx.update(grads, opt_state, params)`` then ``optax.apply_updates``, on the
        transaction's own ``params`` and ``opt_state``, evaluated canonically inside a
        ``proof.jit`` step (:func:`zkdv.jax.optimizer`): the step commits ``grads`` and
        the platform replays the update from it bit for bit on any hardware. Replaces
        :meth:`update` (call one of them once); needs no ``proof.attest`` function. Every
        input of the step other than ``params`` and ``opt_state`` must be part of the
        batch, so that the platform can recompute the gradient. Outside ``proof.jit`` it
        is the plain Optax update.

        Args:
            tx: the ``optax.GradientTransformation`` (wrapped or not).
            grads: the gradient, with the structure of ``params``.

        Returns:
            ``(params, opt_state)`` after the update.
        """
        registration = self._registration
        context = current()
        capture = None if context is None else context.capture
        if registration is None or capture is None:
            updates, new_state = _optimizer.optimizer(tx).update(grads, self.opt_state, self.params)
            new_params = optax.apply_updates(self.params, updates)
            if registration is not None:
                self.update(
                    deltas=updates, params=new_params, opt_state=new_state
                )  # a run that commits no gradient (several devices or processes)
            return new_params, new_state
        if registration.completed:
            raise ZKDVError(UPDATE_TWICE)
        updates, new_state = _optimizer.optimizer(tx).update(grads, self.opt_state, self.params)
        new_params = capture.apply_updates(self.params, updates)
        registration.recorded = capture.recorded
        self.update(deltas=updates, params=new_params, opt_state=new_state)
        return new_params, new_state

    def update(
        self,
        *,
        deltas: Any,
        params: Any,
        opt_state: Any,
        grads: Any = None,
        tx: Any = None,
    ) -> None:
        """Declare the additive parameter update and the post-update state.

        With ``grads`` and ``tx`` the update is declared to be the Optax transformation
        ``tx`` applied to ``grads``: inside a ``proof.jit`` step the step commits
        ``grads`` and its post-update state is ``tx``'s update evaluated canonically, as
        :meth:`apply`'s is (:func:`zkdv.jax.optimizer`); the ``params`` and
        ``opt_state`` the function returns are that state, and its own update is left to
        XLA to remove. The platform replays the update from the committed gradient bit
        for bit on any hardware, and needs no ``proof.attest`` function. Every input of
        the step other than the transaction's ``params`` and ``opt_state`` must be part
        of the batch. Without them the transition is judged by the probes' tolerance
        (``docs/jax.md``, "What each path gets").

        Args:
            deltas: the additive update, with the structure of ``params``
                (``params_after ~= params_before + deltas``).
            params: the post-update parameters.
            opt_state: the post-update optimizer state, with the structure of the
                pre-update one.
            grads: the gradient the update applies, with the structure of the
                pre-update parameters; only with ``tx``.
            tx: the ``optax.GradientTransformation`` the update is (wrapped or not);
                only with ``grads``.

        Raises:
            ZKDVError: one of ``grads`` and ``tx`` without the other, or, inside a
                ``proof.jit`` step, a ``tx`` whose state or update does not have the
                structure of the declared ``opt_state`` or ``params``.
        """
        if (grads is None) != (tx is None):
            raise ZKDVError(_declared.GRADS_AND_TX)
        registration = self._registration
        if registration is None:
            return
        if registration.completed:
            raise ZKDVError(UPDATE_TWICE)
        if tx is not None:
            _declared.declare(registration, tx, grads, self, (deltas, params, opt_state))
        registration.deltas = deltas
        registration.params_after = params
        registration.opt_after = opt_state
        registration.completed = True
