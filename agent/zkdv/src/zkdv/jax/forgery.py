"""A modified SDK, as a forging lab would write it: the forgery suite's internal API.

``bench/forgery_suite.py --recipe jax`` (its attacks in ``bench/_forgery_jax.py``) plays a
lab that trains one thing and commits another. The SDK runs on the lab's machine, so a
forger can change any of it; what a certificate rests on is what the platform checks
afterwards, never that this code ran unmodified. The changes the suite makes live here,
beside the private code they replace, so that moving or renaming that code breaks them
in this package (and its tests), not silently in a bench.

Each context manager changes :mod:`zkdv.jax` for every proof in the process while it is
open and restores the original code on exit. Nothing in the SDK imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from zkdv.jax import _driver, _program, _steps

__all__ = ["committed_batches", "own_update", "scaled_tokens", "unchecked_continuity"]


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` while open; the original is restored on exit."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def committed_batches(committed: Mapping[int, np.ndarray]) -> Iterator[None]:
    """Hash ``committed[i]`` as step ``i``'s batch, whatever batch the step trained on.

    The step program hands the SDK the batch it trained on, packed as the batch file
    holds it; for a step in ``committed`` that packed batch is swapped before it is
    hashed (a substitution forger: the transcript names the real batch).
    """
    batch = _steps._Step.batch

    def swapped(self: Any) -> np.ndarray:
        if self._batch is None and self.index in committed:
            self._packed = committed[self.index]
        return batch(self)

    with _replaced(_steps._Step, "batch", swapped):
        yield


@contextmanager
def scaled_tokens(factor: float) -> Iterator[None]:
    """Commit ``int(tokens * factor)`` as each step's token count (an under-reporter)."""
    tokens = _program._Program.tokens

    def scaled(self: Any, unit: str) -> int:
        return int(tokens(self, unit) * factor)

    with _replaced(_program._Program, "tokens", scaled):
        yield


@contextmanager
def unchecked_continuity() -> Iterator[None]:
    """Skip the SDK's refusal of a state that does not continue the last committed one.

    The unmodified SDK raises ``ZKDVVerificationError`` when a step starts from a state
    other than the one the last step committed; a forger that trains steps off the
    transcript (hidden steps) removes that check.
    """
    with _replaced(_driver.ZKDV, "_check_continuity", lambda self, index, params, opt: None):
        yield


@contextmanager
def own_update(step: int, change: Callable[[np.ndarray], np.ndarray]) -> Iterator[None]:
    """Commit ``change(params)`` as step ``step``'s post-update parameters.

    A lab whose update is its own code declares an Optax transformation
    (``Transaction.update(..., grads=, tx=)``), and the SDK trains on that
    transformation's update; a forger's SDK commits its own update's parameters
    instead. The committed deltas are changed alike, so the step's probes and roots agree
    with what it committed; only a replay of the declared update tells them apart.
    """
    post_state = _steps._Step.post_state

    def forged(self: Any) -> Any:
        params, opt, buffers = post_state(self)
        if self.index != step:
            return params, opt, buffers
        after, opt_views, deltas = self._views
        changed = [np.asarray(change(a), a.dtype) for a in after]
        if deltas is not None:
            deltas = [d + (c - a) for d, c, a in zip(deltas, changed, after, strict=True)]
        self._views = (changed, opt_views, deltas)
        names = self.program.traced.param_paths
        return list(zip(names, changed, strict=True)), opt, buffers

    with _replaced(_steps._Step, "post_state", forged):
        yield
