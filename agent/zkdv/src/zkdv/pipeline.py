"""``zkdv.pipeline``: where the seeds' core API reference puts it.

One pending backend update. The seeds' API is released API (STYLE.md rule 25), so this
import path keeps working; the implementation lives in :mod:`zkdv.driver.protocol` (the contracts
between the driver and a frontend), and this module re-exports
:class:`~zkdv.driver.protocol.PendingUpdate`. What is as the
seeds document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.driver.protocol import PendingUpdate

__all__ = ["PendingUpdate"]
