"""The runtime every ZKDV frontend shares: the Driver, its pipeline and flow control.

A frontend (``zkdv.jax``, ``zkdv.torch``) is a :class:`Driver` subclass. The package
holds what is the same for every framework:

* :mod:`zkdv.driver.base`: :class:`Driver`, one transcript and its asynchronous
  pipeline (start, submit, commit, check, close), rank 0's role in multi-process runs;
* :mod:`zkdv.driver.protocol`: the two contracts between the driver and a frontend,
  :class:`Submission` (what the driver needs from a frontend, per step) and
  :class:`Runtime` (what a frontend may call on the driver, ``Driver.runtime``), and
  the values that cross between them (:class:`PendingUpdate`, a submitted step's
  state machine; :class:`ReplayOutcome`);
* :mod:`zkdv.driver.flowcontrol`: admission and the per-stage threads
  (:class:`~zkdv.driver.flowcontrol.PipelineQueue`, the overlap policies' bounds);
* :mod:`zkdv.driver.control`: :class:`~zkdv.driver.control.HostControl`, the channel
  on which rank 0 tells the other ranks its decisions.

The frontends' drivers live in their own packages (``zkdv.jax.ZKDV``, ``zkdv.torch.ZKDV``).
"""

from __future__ import annotations

from zkdv.driver.base import Driver
from zkdv.driver.protocol import Leaves, PendingUpdate, ReplayOutcome, Runtime, State, Submission

__all__ = ["Driver", "Leaves", "PendingUpdate", "ReplayOutcome", "Runtime", "State", "Submission"]
