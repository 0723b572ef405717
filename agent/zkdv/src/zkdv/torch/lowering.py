"""``zkdv.torch.lowering``: where the seeds' Torch API reference puts it.

The lowering of an attested transition. The seeds' API is released API (STYLE.md rule
25), so this import path keeps working; the implementation lives in
:mod:`zkdv.torch._lowering`, and this module re-exports
:func:`~zkdv.torch._lowering.lower`. What is as the seeds document it and what changed
is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._lowering import lower

__all__ = ["lower"]
