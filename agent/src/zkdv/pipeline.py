"""``zkdv.pipeline``, the API reference's name of :mod:`zkdv.driver.pipeline`.

A step's state machine and the frontend's :class:`~zkdv.driver.protocol.Submission`
live in the driver package; this module keeps the documented import path.
"""

from __future__ import annotations

from zkdv.driver.pipeline import Leaves, PendingUpdate, ReplayOutcome, State
from zkdv.driver.protocol import Submission

__all__ = ["Leaves", "PendingUpdate", "ReplayOutcome", "State", "Submission"]
