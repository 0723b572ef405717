"""How long XLA takes to compile the canonical update, beside plain Optax, in one run.

    python bench/canonical_compile.py [--leaves 4,16,38] [--rounds 2]

The canonical update (``zkdv.jax.canonical``, section 3.4 of ``docs/jax.md``) is compiled
once per run, at the first step, and again by each replay worker. Its fenced program is
large, so its compile time is the cost a lab sees at the start and the platform at every
replay. Measured for ``clip_by_global_norm(1.0)`` + AdamW on a warmup-cosine schedule
(the LM recipe's optimizer, ``examples/jax/lm.py``) over ``N`` float32 leaves of 64x64,
and for the LM recipe's own parameters (38 leaves): ``jax.jit(...).lower(...).compile()``
of the plain Optax update and of the canonical one, each in a fresh trace (no cache),
the median of ``--rounds``.

Before the long scalar computations were isolated (the global norm fused into every
leaf), 32 leaves of clipping took 33 s and the LM recipe did not compile in 270 s; then
the canonical seconds per leaf were constant (0.40 s a leaf at 38 leaves). Since leaves
of one shape are stacked (one copy of each rule per shape, ``docs/jax.md`` 11.2), the
N leaves of 64x64 compile in nearly the time of one, and the LM recipe, whose 38 leaves
have 9 shapes, is the figure to watch. No target: plain Optax's compile time is the
floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zkdv.jax.canonical import canonical

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "jax"))
import lm

ZERO = jnp.zeros((), jnp.uint32)


def _compile_seconds(tx: optax.GradientTransformation, params: Any, canonical_path: bool) -> float:
    state = tx.init(params)

    def apply(grads: Any, opt_state: Any, params: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if canonical_path:
        program = jax.jit(lambda zero, *args: canonical(apply, zero)(*args))
        args: tuple[Any, ...] = (ZERO, params, state, params)
    else:
        program = jax.jit(apply)
        args = (params, state, params)
    started = time.perf_counter()
    program.lower(*args).compile()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", default="4,16,38")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cases: list[tuple[str, Any]] = [
        (f"{n} leaves of 64x64", {f"w{i}": jnp.ones((64, 64), jnp.float32) for i in range(n)})
        for n in (int(v) for v in args.leaves.split(","))
    ]
    cases.append(("the LM recipe (38 leaves)", lm.initial_state(None, 24, lm.BLOCKS, 0).params))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} cores")
    print(f"{'parameters':<28} {'plain s':>9} {'canonical s':>12} {'per leaf':>9} {'ratio':>7}")
    for label, params in cases:
        leaves = len(jax.tree.leaves(params))
        tx = lm.optimizer(24)
        plain = statistics.median(_compile_seconds(tx, params, False) for _ in range(args.rounds))
        fenced = statistics.median(_compile_seconds(tx, params, True) for _ in range(args.rounds))
        print(
            f"{label:<28} {plain:>9.2f} {fenced:>12.2f} {fenced / leaves:>9.3f}"
            f" {fenced / plain:>6.1f}x  ratio"
        )


if __name__ == "__main__":
    main()
