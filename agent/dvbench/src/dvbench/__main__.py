"""``python -m dvbench COMMAND``: the ``dvbench`` command, where its script is not on PATH.

The same command line as the ``dvbench`` script (``dvbench --help``); its :func:`main`
is what the platform's tests of ``download-report`` and ``verify-report`` call.
"""

from __future__ import annotations

import sys

from dvbench._cli import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
