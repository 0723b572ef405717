"""What a forger's modified SDK does, for the tests that show the verifiers catch it.

ZKDV's own step commits the options it applies (the canonical update reads them after
the optimizer's pre-hooks), so a hook that changes the learning rate inside the step is
an honest, committed change. A forger who trains with another rate than it reports has
to change what the SDK writes; these helpers do that.
"""

from __future__ import annotations

from typing import Any

from zkdv.torch._eager import current_transaction


def hide_learning_rate(optimizer: Any, factor: float, group: int | None = None) -> None:
    """Step ``optimizer`` (a prepared one) with ``factor`` times its learning rate, while
    the transcript commits the rate its groups say.

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
