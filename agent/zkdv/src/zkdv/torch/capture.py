"""``zkdv.torch.capture``: where the seeds' Torch API reference puts it.

The attestation capture context. The seeds' API is released API (STYLE.md rule 25), so
this import path keeps working; the implementation lives in :mod:`zkdv.torch._capture`,
and this module re-exports :class:`~zkdv.torch._capture.AttestationCapture`. What is as
the seeds document it and what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.torch._capture import AttestationCapture

__all__ = ["AttestationCapture"]
