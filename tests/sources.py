"""Where the repository's import roots lie, for tests that start Python in a subprocess."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Each agent distribution keeps its package in its own ``src/``.
AGENT_SOURCES = (REPO / "agent" / "zkdv" / "src", REPO / "agent" / "dvbench" / "src")
#: The agent's import roots as one ``PYTHONPATH`` value.
AGENT_PYTHONPATH = os.pathsep.join(str(path) for path in AGENT_SOURCES)
