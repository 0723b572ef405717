"""``zkdv.torch.checkpoint``: where the seeds' Torch API reference puts it.

The bounded host snapshots for checked replay. The seeds' API is released API (STYLE.md
rule 25), so this import path keeps working; the implementation lives in
:mod:`zkdv.torch._checkpoint`, and this module re-exports
:class:`~zkdv.torch._checkpoint.ReplayCheckpoint`. What is as the seeds document it and
what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._checkpoint import ReplayCheckpoint

__all__ = ["ReplayCheckpoint"]
