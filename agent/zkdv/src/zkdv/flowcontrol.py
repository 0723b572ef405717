"""``zkdv.flowcontrol``: where the seeds' core API reference puts it.

The bounded queue of pipeline transactions. The seeds' API is released API (STYLE.md
rule 25), so this import path keeps working; the implementation lives in
:mod:`zkdv.driver.flowcontrol`, and this module re-exports
:class:`~zkdv.driver.flowcontrol.PipelineQueue`. What is as the seeds document it and
what changed is listed in ``docs/seed-api.md``.
"""

from __future__ import annotations

from zkdv.driver.flowcontrol import PipelineQueue

__all__ = ["PipelineQueue"]
