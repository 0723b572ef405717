"""The symbolic side of a ``proof.jit`` trace: which transaction a traced function declares.

While ``proof.jit`` traces a training function it installs a :class:`TraceContext` on
the tracing thread. :class:`~zkdv.jax.Transaction` (``_transaction``) and the contrib
``TrainState.apply_gradients`` register their values with it; outside such a trace
they are inert markers, so the same code runs unchanged under ``jax.jit`` or eagerly. Nothing here opens a transcript
transaction: the ``proof.jit`` wrapper opens exactly one per actual invocation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jax_core

from zkdv.errors import ZKDVError
from zkdv.overlap import Policy

__all__ = ["Boundary", "Registration", "TraceContext", "collector", "current"]

_local = threading.local()

ONE_TRANSACTION = (
    "a proof.jit function declares exactly one transaction per invocation; it already "
    "declared one (call state.apply_gradients() or zkdv.jax.Transaction once per step)"
)
UPDATE_MISSING = (
    "zkdv.jax.Transaction(...) was opened but transaction.update(deltas=..., params=..., "
    "opt_state=...) was never called in the proof.jit function"
)
UPDATE_TWICE = "transaction.update(...) may be called only once per transaction"


@dataclass
class Registration:
    """The values one traced invocation declared for its transaction."""

    source: str
    params_before: Any
    opt_before: Any
    batch: Any
    overlap: Policy | None
    deltas: Any = None
    params_after: Any = None
    opt_after: Any = None
    state: Any = None
    completed: bool = False
    #: Several updates in one call (``zkdv.jax.scan``): a ``zkdv.jax._scan.ScanUpdates``.
    scan: Any = None
    #: The optimizer update the step's gradient is committed with
    #: (``zkdv.jax._optimizer.Recorded``); None: the run commits no gradient.
    recorded: Any = None
    #: Pre-update continuity leaves the update increments by one (a ``step``).
    counters: tuple[Any, ...] = ()
    #: Gradient leaves that replace parameters (Flax ``OVERWRITE_WITH_GRADIENT``).
    overwrite: tuple[Any, ...] = ()
    #: The step's computed values (traced), once the update is described.
    computed: list[Any] = field(default_factory=list)


class Boundary(BaseException):
    """Raised at the symbolic update boundary while replaying a staged function.

    A BaseException, so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, values: tuple[Any, Any, Any]) -> None:
        super().__init__("zkdv update boundary")
        self.values = values


@dataclass
class TraceContext:
    """One trace of a ``proof.jit`` function (or of its generated replay program).

    Attributes:
        proof: the owning driver.
        mode: ``"production"`` (the training step) or ``"replay"`` (the generated
            sampled program: stop at the update boundary).
        inputs: the traced function's dynamic input leaves, for binding by identity.
        capture: where the step's optimizer update is recorded when the run commits its
            gradients (a ``zkdv.jax._optimizer.Capture``, holding the program's runtime
            zero); None otherwise.
    """

    proof: Any
    mode: str
    inputs: list[Any]
    capture: Any = None
    registration: Registration | None = None
    params_identity: tuple[int, ...] = field(default_factory=tuple)
    # The JAX trace the context was opened in: an update registered from another one
    # (inside jax.lax.scan, cond, vmap or a nested jit) cannot reach the step's outputs.
    trace: Any = field(default_factory=lambda: trace_state())

    def open(self, registration: Registration) -> None:
        if self.registration is not None:
            raise ZKDVError(ONE_TRANSACTION)
        self.registration = registration

    def nested(self) -> bool:
        """Whether the caller runs inside a JAX transformation of this context's trace."""
        return bool(trace_state() != self.trace)


def trace_state() -> Any:
    """The current JAX trace, opaque; equal only within one trace."""
    return jax_core.get_opaque_trace_state()  # type: ignore[no-untyped-call]


def current() -> TraceContext | None:
    """The trace context active on this thread, or None."""
    return getattr(_local, "context", None)


def collector() -> list[Any] | None:
    """The list :func:`zkdv.jax.index` records into while deriving a transition."""
    return getattr(_local, "collector", None)


@contextmanager
def active(context: TraceContext) -> Iterator[TraceContext]:
    previous = current()
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


@contextmanager
def collecting() -> Iterator[list[Any]]:
    previous = collector()
    trees: list[Any] = []
    _local.collector = trees
    try:
        yield trees
    finally:
        _local.collector = previous
