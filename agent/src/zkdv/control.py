"""``zkdv.control``, the API reference's name of :mod:`zkdv.driver.control`.

The multi-process host channel lives in the driver package; this module keeps the
documented import path.
"""

from __future__ import annotations

from zkdv.driver.control import HostControl

__all__ = ["HostControl"]
