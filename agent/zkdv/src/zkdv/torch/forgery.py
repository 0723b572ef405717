"""A modified SDK, as a forging lab would write it: the forgery suite's internal API.

``bench/forgery_suite.py`` plays a lab that trains one thing and commits another, and the
verifiers' tests (``tests/provers``, ``tests/attestations``, ``tests/agent/zkdv/torch``)
show that the checks catch it. The SDK runs on the lab's machine, so a forger can change
any of it; what a certificate rests on is what the platform checks afterwards, never that
this code ran unmodified. The changes the suite and the tests make to :mod:`zkdv.torch`
live here, beside the private code they replace, so that moving or renaming that code
breaks them in this package, not silently in a bench or another package's test.

Each function but :func:`hide_learning_rate` changes the frontend for every proof in the
process and returns the function that undoes it. Nothing in the SDK imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zkdv.torch import _driver, _packing
from zkdv.torch._eager import current_transaction

__all__ = ["hide_learning_rate", "scaled_flops", "scaled_tokens", "uncounted_flops"]


def scaled_tokens(factor: float) -> Callable[[], None]:
    """The step records commit ``int(tokens * factor)``: the batch packing's token count
    (:func:`zkdv.batch.count_tokens`, looked up by ``_packing`` at every step) scaled."""
    namespace = vars(_packing)
    real = namespace["count_tokens"]

    def fewer(*args: Any, **kwargs: Any) -> int:
        return int(real(*args, **kwargs) * factor)

    namespace["count_tokens"] = fewer

    def restore() -> None:
        namespace["count_tokens"] = real

    return restore


def scaled_flops(factor: float) -> Callable[[], None]:
    """The root and step records commit ``factor`` times the program's FLOPs: Torch's
    FLOP counter at sealing (``count_flops``, looked up by the driver) scaled."""
    namespace = vars(_driver)
    real = namespace["count_flops"]

    def fewer(*args: Any, **kwargs: Any) -> float | None:
        counted = real(*args, **kwargs)
        return None if counted is None else counted * factor

    namespace["count_flops"] = fewer

    def restore() -> None:
        namespace["count_flops"] = real

    return restore


def uncounted_flops() -> Callable[[], None]:
    """Torch's FLOP counter fails at sealing (``count_flops`` returns None), as on a
    program it cannot run: the root commits the estimate of 6 x parameters x tokens and
    says so. Not a forgery: the provers' tests of that estimate need such a program."""
    namespace = vars(_driver)
    real = namespace["count_flops"]
    namespace["count_flops"] = lambda *args, **kwargs: None

    def restore() -> None:
        namespace["count_flops"] = real

    return restore


def hide_learning_rate(optimizer: Any, factor: float, group: int | None = None) -> None:
    """Step ``optimizer`` (a prepared one) with ``factor`` times its learning rate, while
    the transcript commits the rate its groups say.

    ZKDV's own step commits the options it applies (the canonical update reads them after
    the optimizer's pre-hooks), so a hook that changes the learning rate inside the step
    is an honest, committed change; a forger who trains with another rate than it reports
    has to change what the SDK writes, as this does. It changes this optimizer only, for
    as long as it lives.

    Args:
        optimizer: the :class:`~zkdv.torch._prepared.PreparedOptimizer`.
        factor: how much larger the rate of the update is than the committed one.
        group: the parameter group to change (None: every group).
    """
    native = optimizer.optimizer
    chosen = range(len(native.param_groups)) if group is None else [group]

    def scale(native: Any, args: Any, kwargs: Any) -> None:
        for index in chosen:
            native.param_groups[index]["lr"] *= factor

    def report_unscaled(native: Any, args: Any, kwargs: Any) -> None:
        for index in chosen:
            native.param_groups[index]["lr"] /= factor
        transaction = current_transaction()
        committed = None if transaction is None else transaction.hyperparameters
        for index in chosen if committed is not None else ():
            committed[index]["lr"] /= factor  # type: ignore[index]

    native.register_step_pre_hook(scale)
    native.register_step_post_hook(report_unscaled)
