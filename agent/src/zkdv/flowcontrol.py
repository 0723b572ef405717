"""``zkdv.flowcontrol``, the API reference's name of :mod:`zkdv.driver.flowcontrol`.

Admission and the pipeline's stage threads live in the driver package; this module
keeps the documented import path.
"""

from __future__ import annotations

from zkdv.driver.flowcontrol import STAGES, Admission, Annotation, PipelineQueue, unannotated

__all__ = ["STAGES", "Admission", "Annotation", "PipelineQueue", "unannotated"]
