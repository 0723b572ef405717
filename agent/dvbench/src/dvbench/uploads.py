"""How the SDK uploads one proof directory's files: an internal API for the benches.

:meth:`dvbench.DVBenchProof.finish` uploads through these; the benches that measure
that path without a training run reach it here rather than through private modules:

* ``bench/bench_api.py`` uploads one file with :class:`Uploader` over a
  :class:`Manifest` in a fresh process, to read the SDK's peak memory and time;
* ``bench/challenges_per_hour.py`` files a run's artifacts on the platform under the
  kinds the SDK gives them (:func:`kind_of`).

The implementations are :mod:`dvbench._manifest` and :mod:`dvbench._sync`.
"""

from __future__ import annotations

from dvbench._manifest import Manifest, kind_of
from dvbench._sync import Uploader

__all__ = ["Manifest", "Uploader", "kind_of"]
