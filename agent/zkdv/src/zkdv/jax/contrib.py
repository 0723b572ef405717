"""Flax integration: a ``TrainState`` whose ``apply_gradients`` declares the transaction.

:class:`TrainState` is ``flax.training.train_state.TrainState`` plus three static
(non-PyTree) fields: ``proof``, ``attest_apply_fn`` and ``zkdv_overlap``. Under
``jax.jit`` or eagerly it is plain Flax. Under ``proof.jit`` its ``apply_gradients``
performs the same Optax transition and registers it with the trace; the attested program
is generated from the staged training function (``docs/jax.md``).

A state created with a proof has its ``tx`` wrapped by :func:`zkdv.jax.optimizer`: in a
``proof.jit`` step that commits its gradients (one process, one device or sharded), the
gradient ``apply_gradients`` receives is committed, the Optax update and
``apply_updates`` are evaluated canonically, and the fields passed as ``**kwargs`` (for
example ``batch_stats``) are the step's carried values.
"""

# Flax's struct and TrainState APIs carry no type annotations.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from zkdv.errors import ZKDVError
from zkdv.jax import _context, _messages, _optimizer
from zkdv.overlap import Policy

__all__ = ["TrainState", "continuity"]

# Flax's key for FP8 scale parameters that are overwritten by their "gradient".
OVERWRITE_WITH_GRADIENT: str = train_state.OVERWRITE_WITH_GRADIENT  # type: ignore[attr-defined]


def continuity(state: Any) -> Any:
    """The optimizer-state continuity tree: every dynamic state leaf except ``params``.

    That is ``step``, the Optax state and any dynamic field a subclass adds (for
    example ``batch_stats``), as one PyTree with paths like ``.opt_state[0].mu``.
    """
    return state.replace(params=None)


def _delta(before: Any, update: Any, after: Any) -> Any:
    # For float32/float64 parameters the Optax update is the additive delta exactly as
    # applied (optax.apply_updates adds it). Lower-precision parameters round the sum,
    # so their delta is the realized difference in float32, which keeps the probe
    # identity post = pre + delta within tolerance.
    if update is not None and jnp.dtype(after.dtype) in (jnp.float32, jnp.float64):
        return jnp.asarray(update).astype(after.dtype)
    return jnp.asarray(after).astype(jnp.float32) - jnp.asarray(before).astype(jnp.float32)


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` with a ZKDV proof owner.

    Attributes:
        proof: the ``zkdv.jax.ZKDV`` driver that owns this state's updates.
        attest_apply_fn: an exportable replacement for ``apply_fn`` used only when
            ZKDV replays a sampled update (None: use ``apply_fn``).
        zkdv_overlap: the overlap policy of each update of this state
            (``zkdv.overlap.UNCHECKED`` by default).
    """

    proof: Any = struct.field(pytree_node=False)
    attest_apply_fn: Callable[..., Any] | None = struct.field(pytree_node=False)
    zkdv_overlap: Policy = struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        proof: Any = None,
        attest_apply_fn: Callable[..., Any] | None = None,
        zkdv_overlap: Policy = Policy.UNCHECKED,
        **kwargs: Any,
    ) -> Any:
        """Create a state with ``step=0`` and ``opt_state = tx.init(params)``.

        Args:
            apply_fn: the model's apply function.
            params: the parameters updated by ``tx``.
            tx: the Optax transformation; with a ``proof`` it is wrapped by
                :func:`zkdv.jax.optimizer` (unchanged outside ``proof.jit``).
            proof: the ZKDV driver that owns this state's updates.
            attest_apply_fn: exportable replacement for ``apply_fn`` in sampled replay.
            zkdv_overlap: overlap policy of this state's updates.
            **kwargs: further fields of a subclass (for example ``batch_stats``).
        """
        state = super().create(
            apply_fn=apply_fn,
            params=params,
            tx=tx if proof is None else _optimizer.optimizer(tx),
            proof=proof,
            attest_apply_fn=attest_apply_fn,
            zkdv_overlap=Policy(zkdv_overlap),
            **kwargs,
        )
        note = getattr(proof, "_note_state", None)
        if note is not None:
            note()
        return state

    def _zkdv_donatable(self) -> list[Any]:
        # Donating the state donates only its parameters: a sampled check may still
        # need the pre-update optimizer state.
        return list(jax.tree.leaves(self.params))

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> Any:
        """Apply the Optax update, increment ``step``, replace ``kwargs`` fields.

        Identical to Flax's method (``OVERWRITE_WITH_GRADIENT`` included). Under
        ``proof.jit`` it also registers the transition with the trace; in a run that
        commits its gradients it records ``grads`` as the step's committed gradient and
        the ``kwargs`` fields (``batch_stats=...``) as its carried values, and the state
        the step returns is the committed apply program's: the canonical update of those
        values (``docs/jax.md``, section 3.4).

        Raises:
            ZKDVError: under ``proof.jit`` of another proof (proof identity error).
        """
        context = _context.current()
        if context is None:
            if self.proof is not None and isinstance(self.step, jax.core.Tracer):
                warnings.warn(_messages.UNTRACKED_UPDATE, stacklevel=2)
            return super().apply_gradients(grads=grads, **kwargs)
        if self.proof is not context.proof:
            owner = "no proof" if self.proof is None else "a different proof object"
            raise ZKDVError(_messages.PROOF_IDENTITY.format(owner=owner))
        if context.nested():
            raise ZKDVError(_messages.NESTED_UPDATE)
        overwrite = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
        if overwrite:
            grads_with_opt, params_with_opt = grads["params"], self.params["params"]
        else:
            grads_with_opt, params_with_opt = grads, self.params
        # A production step's update, or one of a zkdv.jax.scan body's (section 3.2).
        capture = context.capture if context.mode in ("production", "scan") else None
        if capture is not None:
            # The run commits its gradient: the wrapped update records it and is canonical.
            tx = _optimizer.optimizer(self.tx)
            updates, new_opt_state = tx.update(grads_with_opt, self.opt_state, params_with_opt)
            new_params_with_opt = capture.apply_updates(params_with_opt, updates)
        else:
            updates, new_opt_state = _optimizer.inner(self.tx).update(
                grads_with_opt, self.opt_state, params_with_opt
            )
            new_params_with_opt = optax.apply_updates(params_with_opt, updates)
        if overwrite:
            new_params = {
                "params": new_params_with_opt,
                OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT],
            }
            # Same container as the input params, so the deltas share its structure.
            structure = jax.tree.structure(self.params)
            aligned = jax.tree.unflatten(structure, jax.tree.leaves(new_params))
            deltas = jax.tree.map(lambda b, a: _delta(b, None, a), self.params, aligned)
        else:
            new_params = new_params_with_opt
            deltas = jax.tree.map(_delta, self.params, updates, new_params)
        new = self.replace(
            step=self.step + 1,
            params=new_params,
            opt_state=new_opt_state,
            **kwargs,
        )
        if context.mode == "replay":
            raise _context.Boundary((deltas, new.params, continuity(new)))
        context.open(
            _context.Registration(
                "train_state",
                self.params,
                continuity(self),
                None,
                None,
                deltas=deltas,
                params_after=new.params,
                opt_after=continuity(new),
                state=self,
                completed=True,
                recorded=None if capture is None else capture.recorded,
                counters=(self.step,),
                overwrite=tuple(jax.tree.leaves(grads[OVERWRITE_WITH_GRADIENT]))
                if overwrite
                else (),
            )
        )
        return new
