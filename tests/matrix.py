"""How much of a cross-environment sweep the suite runs.

The sweeps that train runs under other CPU kernel families, instruction sets and thread
counts and replay them here cost one training process per environment and one replay
per run. By default the suite covers every environment and every recipe at least once;
``ZKDV_TEST_MATRIX=full`` runs every (environment, recipe, seed) cell, as a release or a
change to the replay's bounds should. ``bench/cross_hardware.py`` measures the
false-alarm rate over many more runs (docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

FULL = os.environ.get("ZKDV_TEST_MATRIX", "").strip().lower() == "full"


def cells(environments: int, recipes: Sequence[str], runs: int) -> list[tuple[int, str, int]]:
    """The (environment, recipe, run) cells to train and replay.

    Full: all of them. Otherwise one run per environment, the recipes taken in turn, and
    as many more environments (from the first again) as it takes to cover every recipe.
    """
    if FULL:
        return [(e, r, run) for e in range(environments) for r in recipes for run in range(runs)]
    count = max(environments, len(recipes))
    return [(i % environments, recipes[i % len(recipes)], 0) for i in range(count)]


def cell_id(cell: tuple[int, str, int]) -> str:
    environment, recipe, run = cell
    return f"{environment}-{recipe}-{run}"
