"""``zkdv.torch.capture``: where the seeds' Torch API reference puts it.

The attestation capture context. The seeds' API is released API (STYLE.md rule 25), so
this import path keeps working; the implementation lives in :mod:`zkdv.torch._capture`,
and this module re-exports :class:`~zkdv.torch._capture.AttestationCapture`. What is as
the seeds document it and what changed is listed in ``docs/seed-api.md``.

It also re-exports :func:`~zkdv.torch._capture.current_capture` (the capture being
traced, or None in eager code), an internal API beyond the seeds': a training step that
behaves differently when it is traced than when it runs eagerly (the forgery suite's
spoofing forgers, ``bench/forgery_suite.py``) asks it which one it is in.
"""

from __future__ import annotations

from zkdv.torch._capture import AttestationCapture, current_capture

__all__ = ["AttestationCapture", "current_capture"]
