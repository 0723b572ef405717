"""``zkdv.torch.prepared``: where the seeds' Torch API reference puts it.

The prepared optimizer. The seeds' API is released API (STYLE.md rule 25), so this
import path keeps working; the implementation lives in :mod:`zkdv.torch._prepared`, and
this module re-exports :class:`~zkdv.torch._prepared.PreparedOptimizer`. What is as the
seeds document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._prepared import PreparedOptimizer

__all__ = ["PreparedOptimizer"]
