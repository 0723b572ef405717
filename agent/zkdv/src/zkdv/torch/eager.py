"""``zkdv.torch.eager``: where the seeds' Torch API reference puts it.

One eager transaction. The seeds' API is released API (STYLE.md rule 25), so this import
path keeps working; the implementation lives in :mod:`zkdv.torch._eager`, and this
module re-exports :class:`~zkdv.torch._eager.EagerTransaction`. What is as the seeds
document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._eager import EagerTransaction

__all__ = ["EagerTransaction"]
