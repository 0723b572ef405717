"""``zkdv.torch.pipeline``: where the seeds' Torch API reference puts it.

The Torch transaction pipeline. The seeds' API is released API (STYLE.md rule 25), so
this import path keeps working; the implementation lives in :mod:`zkdv.torch._pipeline`,
and this module re-exports :class:`~zkdv.torch._pipeline.Pipeline`. What is as the seeds
document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._pipeline import Pipeline

__all__ = ["Pipeline"]
