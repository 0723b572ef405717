"""The fuzzing budget shared by the hostile-input tests.

CI runs a bounded number of examples per property; ``DVBENCH_FUZZ_EXAMPLES`` raises it for
a longer run on demand (``DVBENCH_FUZZ_EXAMPLES=5000 pytest tests/reliability``). No
deadline: the machine is shared, and a hang is caught by the bounded input sizes and by
pytest's own run time, not by timing single examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("DVBENCH_FUZZ_EXAMPLES", "60"))


def budget(scale: float = 1.0) -> settings:
    """Hypothesis settings with ``scale`` times the configured number of examples."""
    return settings(
        max_examples=max(1, int(EXAMPLES * scale)),
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )
