"""What changes a TPU's gradient bits: one fixed LM step's gradient under each variant.

Each variant is a fresh process (environment variables, flags) that computes the
gradient of ``examples/jax/lm.py``'s two-block LM (clipping and AdamW aside: the
gradient alone, two accumulated micro-batches) on its first batch, under ``jax.jit``,
and saves it. The parent prints, per variant, whether its bits equal the first
default run's, how many of the leaves differ, and the difference's norm over the
gradient's. A variant whose flags the runtime refuses says so. ``VARIANTS`` (names,
comma-separated) picks some.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "default again (a second process)": {},
    "matmul precision bfloat16 (explicit)": {"JAX_DEFAULT_MATMUL_PRECISION": "bfloat16"},
    "matmul precision float32 (bf16_3x)": {"JAX_DEFAULT_MATMUL_PRECISION": "float32"},
    "matmul precision highest": {"JAX_DEFAULT_MATMUL_PRECISION": "highest"},
    "XLA_FLAGS --xla_allow_excess_precision=false": {
        "XLA_FLAGS": "--xla_allow_excess_precision=false"
    },
    "LIBTPU_INIT_ARGS latency-hiding scheduler off": {
        "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false"
    },
    "cpu (JAX_PLATFORMS=cpu)": {"JAX_PLATFORMS": "cpu"},
}


def child(out: Path) -> None:
    sys.path.insert(0, "examples/jax")
    import jax
    import jax.numpy as jnp
    import lm

    state = lm.initial_state(None, blocks=2)
    tokens = jnp.asarray(lm.token_batches(1)[0])
    _, grads = jax.jit(lm.loss_and_grads)(state, tokens)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    arrays = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
    np.savez(out, backend=np.asarray(jax.default_backend()), **arrays)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(Path(sys.argv[2]))
        return 0
    wanted = [v for v in os.environ.get("VARIANTS", "").split(",") if v] or list(VARIANTS)
    where = Path(tempfile.mkdtemp())
    reference: dict[str, np.ndarray] | None = None
    for index, name in enumerate(wanted):
        out = where / f"{index}.npz"
        result = subprocess.run(
            [sys.executable, __file__, "child", str(out)],
            env={**os.environ, **VARIANTS[name]},
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
            print(f"{name}: failed (exit {result.returncode}): {tail}", flush=True)
            continue
        with np.load(out) as saved:
            backend = str(saved["backend"])
            grads = {k: saved[k] for k in saved.files if k != "backend"}
        if reference is None:
            reference = grads
            print(f"{name} [{backend}]: the reference, {len(grads)} leaves", flush=True)
            continue
        differ = [k for k in grads if grads[k].tobytes() != reference[k].tobytes()]
        diff = np.sqrt(sum(float(np.sum((grads[k] - reference[k]) ** 2.0)) for k in grads))
        norm = np.sqrt(sum(float(np.sum(reference[k] ** 2.0)) for k in grads))
        verdict = "bitwise equal" if not differ else f"{len(differ)} of {len(grads)} leaves differ"
        print(f"{name} [{backend}]: {verdict}; |diff| / |grad| = {diff / norm:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
