"""``zkdv.torch.artifact``: where the seeds' Torch API reference puts it.

The hermetic AOT artifact round trip. The seeds' API is released API (STYLE.md rule 25),
so this import path keeps working; the implementation lives in
:mod:`zkdv.torch._artifact`, and this module re-exports
:func:`~zkdv.torch._artifact.roundtrip`. What is as the seeds document it and what
changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._artifact import roundtrip

__all__ = ["roundtrip"]
