"""Train recipe runs and forgeries in this process: the lab's side of the cross-kernel tests.

    python -m tests.agent.zkdv.torch.train_elsewhere DIR THREADS RUN...

Each RUN is ``recipe:<name>:<seed>`` (a recipe of ``test_torch_recipes``, every step
checked by the SDK) or ``forgery:<name>`` (a forgery of the LM recipe, no SDK checks, as a
forger files it), written to ``DIR/RUN``. The caller picks the kernels with the
environment (``zkdv.calibrate.kernels``): one process trains many runs on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.agent.zkdv.torch import test_torch_recipes as recipes


def main(argv: list[str]) -> None:
    directory, threads, runs = Path(argv[0]), int(argv[1]), argv[2:]
    torch.set_num_threads(threads)
    for run in runs:
        kind, name, *seed = run.split(":")
        if kind == "forgery":
            recipes.FORGERIES[name](directory / run, name, recipes.NO_CHECKS)
        else:
            recipe = recipes.RECIPES.get(name) or recipes.FRAMEWORK_RECIPES[name]
            recipe(directory / run, seed=int(seed[0]), zkdv_config=recipes.EVERY_STEP)


if __name__ == "__main__":
    main(sys.argv[1:])
