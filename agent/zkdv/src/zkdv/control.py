"""``zkdv.control``: where the seeds' core API reference puts it.

The multi-process host channel. The seeds' API is released API (STYLE.md rule 25), so
this import path keeps working; the implementation lives in :mod:`zkdv.driver.control`,
and this module re-exports :class:`~zkdv.driver.control.HostControl`. What is as the
seeds document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.driver.control import HostControl

__all__ = ["HostControl"]
