"""A modified SDK, as a forging lab would write it: the forgery suite's internal API.

``bench/forgery_suite.py`` plays a lab that trains one thing and commits another. The
SDK runs on the lab's machine, so a forger can change any of it; what a certificate
rests on is what the platform checks afterwards, never that this code ran unmodified.
The changes the suite makes to :mod:`zkdv.torch` live here, beside the private code they
replace, so that moving or renaming that code breaks them in this package, not silently
in a bench.

Each function changes the frontend for every proof in the process and returns the
function that undoes it. Nothing in the SDK imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zkdv.torch import _driver, _packing

__all__ = ["scaled_flops", "scaled_tokens"]


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
