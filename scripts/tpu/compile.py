"""How long the backend compiles the canonical update, with and without its isolated
regions (``_Arithmetic.isolated``), beside plain Optax: one line per case, as it goes.

    python scripts/tpu/compile.py [CASE ...]     # cases: digits, adam4, lm4, lm38

Run on the TPU machine and on a CPU: the canonical program's compile time is what a lab
waits for at its first step and a replay worker at each challenge.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zkdv.jax import _canonical_rules, _canonical_sums
from zkdv.jax.canonical import canonical

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "jax"))

ZERO = jnp.zeros((), jnp.uint32)


def _cases() -> dict[str, tuple[optax.GradientTransformation, Any]]:
    import lm

    digits = {
        "Dense_0": {"kernel": jnp.ones((64, 64)), "bias": jnp.ones((64,))},
        "Dense_1": {"kernel": jnp.ones((64, 10)), "bias": jnp.ones((10,))},
    }
    return {
        "digits": (optax.adam(1e-2), digits),
        "adam4": (optax.adam(1e-2), {f"w{i}": jnp.ones((64, 64)) for i in range(4)}),
        "lm4": (lm.optimizer(24), {f"w{i}": jnp.ones((64, 64)) for i in range(4)}),
        "lm38": (lm.optimizer(24), lm.initial_state(None, 24, lm.BLOCKS, 0).params),
    }


def _compile(tx: optax.GradientTransformation, params: Any, mode: str) -> tuple[float, str]:
    state = tx.init(params)

    def apply(grads: Any, opt_state: Any, params: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if mode == "plain":
        program, args = jax.jit(apply), (params, state, params)
    else:
        limit = 16 if mode == "isolated" else -1
        _canonical_rules.ISOLATED = _canonical_sums.ISOLATED = limit
        program = jax.jit(lambda zero, *a: canonical(apply, zero)(*a))
        args = (ZERO, params, state, params)
    started = time.perf_counter()
    lowered = program.lower(*args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    text = compiled.as_text() or ""
    stats = (
        f"lower {traced - started:6.2f} s, HLO {len(text.splitlines()):6d} lines, "
        f"{text.count(' conditional(')} conditionals, {text.count(' fusion(')} fusions"
    )
    return done - traced, stats


def main() -> None:
    cases = _cases()
    names = sys.argv[1:] or list(cases)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    for name in names:
        tx, params = cases[name]
        leaves = len(jax.tree.leaves(params))
        for mode in os.environ.get("MODES", "plain,isolated,inline").split(","):
            seconds, stats = _compile(tx, params, mode)
            print(
                f"{name:>7} ({leaves:2d} leaves) {mode:>9}: compile {seconds:7.2f} s; {stats}",
                flush=True,
            )


if __name__ == "__main__":
    main()
