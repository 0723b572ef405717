"""The Torch driver at the API reference's layout, ``zkdv.driver.<backend>``.

The implementation lives in :mod:`zkdv.torch._driver`; ``zkdv.torch.ZKDV`` is the same
class.
"""

from __future__ import annotations

from zkdv.torch._driver import PROGRAM_KIND_ENV, ZKDV

__all__ = ["PROGRAM_KIND_ENV", "ZKDV"]
