"""Import target used by packaged ZKDV Torch AOT guards.

Lowered graph code that is executed from source (the ``torch.export`` program kind)
runs in this module's namespace, so its tracebacks and pickled references name a
stable, importable module instead of ``__main__``.
"""

from __future__ import annotations
