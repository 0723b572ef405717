"""What exact probes cost the host path: the same probe rows, two ways, side by side.

    python bench/probe_cost.py [--repeat 7] [--steps 20] [--rounds 3]

Probes are exact in any summation order (``zkdv.probes``: Ozaki splitting, float64
products of integer slices) so that the host and the device paths write the same bits.
Before issue 18 the host path projected each leaf's probe rows with one float32 matrix
product. This prints, for the parameter shapes of ``bench/torch_overhead.py``'s workloads
and of a two-layer toy, the time per training step of

* **float32 product**: what the host path did before, pre-update, post-update and delta
  rows of every leaf, one ``rows @ Q`` each (not exact: its bits depend on the BLAS);
* **exact, one call per array**: ``ProbeSet.project_rows`` three times per leaf;
* **exact, per step**: ``ProbeSet.project_steps``, as the Torch host path runs it: the
  leaves of one width in one split and finish, the pre-update probe reused from the
  previous step's post-update probe; on the numpy path, and (where Numba is installed,
  the default path then) as one compiled pass per width class: split, products and
  finish in one loop that holds no interpreter lock, with the same bits;
* **floor of exactness**: the float64 products alone, for the arrays a step projects
  (post-update and delta rows, two slices each), split beforehand. Two slices are what
  the exact definition needs: a row's probe keeps ``2w`` bits below its peak, more than
  one float64 product of ``w``-bit matrix entries over ``d`` terms can sum exactly.
  Two ways, and the floor is the faster: **BLAS**, in single-threaded row blocks as the
  numpy path runs them (``zkdv.probe_pass.gemm``: waking every BLAS thread for a probe
  costs more than it saves while training owns the cores), and **compiled**, the
  compiled pass's own dot products (``zkdv.probe_pass.products_kernel``) over the
  split rows, two rows and four or two columns at a time as the pass takes them;
* **the split alone**: the same rows split into their two slices (``zkdv.probe_pass.split_kernel``
  per element, one call per width), which the floor leaves out but exactness cannot:
  on rows of a few hundred floats, with one to six probe columns, it costs more than
  half as much as the products. The last line adds it to the floor.

Each variant's best block over ``--rounds`` interleaved rounds, with its ratio to the
float32 product and to the floor; the goal is the exact path within 1.5x of its floor.
The exact pass splits, multiplies and finishes in one sweep over rows that stay in L1;
it can come in under the BLAS floor, not under the compiled one.
One thread, no training running beside it: this is the work itself. In a training run
the commit thread shares the cores with the step, so the wall time it takes is larger
(``docs/torch.md``, "What exact probes cost on the host path").
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from zkdv.merkle import LeafSpec
from zkdv.probe_pass import (
    JIT_ENV,
    compiled_pass,
    gemm,
    padded_columns,
    products_kernel,
    split_kernel,
)
from zkdv.probes import ProbeSet, exact_rows, slice_width

PROBE_RATIO = 0.01  # ZKDVConfig's default


def interleaved(split: np.ndarray) -> np.ndarray:
    """:func:`zkdv.probes.exact_rows`' slices (every row's high slice, then every low
    one) as the pass holds them: per pair of rows, high, low, high, low (a last row alone
    is taken twice, as the pass does)."""
    rows = len(split) // 2
    order = []
    for r in range(0, rows, 2):
        other = min(r + 1, rows - 1)
        order += [r, rows + r, other, rows + other]
    return np.ascontiguousarray(split[order])


def split_alone(rows: Sequence[np.ndarray]) -> Callable[[], None] | None:
    """The split as the exact pass computes it, alone, over the float32 ``rows`` of every
    leaf, one call per width (a necessary part of exactness that the floor, the
    products alone, leaves out); None where the exact pass is not compiled."""
    kernel = split_kernel()
    if kernel is None:
        return None
    widths: dict[int, list[np.ndarray]] = {}
    for values in rows:
        widths.setdefault(values.shape[1], []).append(values)
    work = [
        (np.concatenate(block), slice_width(d), np.empty((2, d))) for d, block in widths.items()
    ]

    def run() -> None:
        for values, width, slices in work:
            kernel(values, width, slices)

    return run


def blas_floor(split: Sequence[np.ndarray], matrices: Sequence[np.ndarray]) -> Callable[[], None]:
    """The BLAS floor of exactness as a call: the float64 products of each leaf's
    ``split`` rows (:func:`zkdv.probes.exact_rows`) and its probe matrix, in
    single-threaded row blocks as the numpy path runs them (:func:`zkdv.probe_pass.gemm`)."""
    work = [
        (rows, matrix.astype(np.float64), np.empty((len(rows), matrix.shape[1])))
        for rows, matrix in zip(split, matrices, strict=True)
    ]

    def run() -> None:
        for rows, wide, out in work:
            gemm(rows, wide, out)

    return run


def compiled_floor(
    split: Sequence[np.ndarray], matrices: Sequence[np.ndarray]
) -> Callable[[], None] | None:
    """The compiled floor of exactness as a call: the exact pass's dot products alone
    over each leaf's ``split`` rows (:func:`zkdv.probes.exact_rows`) and its probe
    matrix; None where the exact pass is not compiled."""
    dots = products_kernel()
    if dots is None:
        if compiled_pass():
            raise RuntimeError("the exact pass is compiled but its dot products alone are not")
        return None
    work = []
    for rows, matrix in zip(split, matrices, strict=True):
        d, k = matrix.shape
        padded = np.zeros((padded_columns(k), d))
        padded[:k] = matrix.T
        slices = interleaved(rows)
        work.append((slices, padded, np.empty((len(slices), k))))

    def run() -> None:
        for slices, padded, out in work:
            dots(slices, padded, out)

    return run


def _linear(fan_in: int, fan_out: int) -> list[tuple[int, ...]]:
    return [(fan_out, fan_in), (fan_out,)]


def shapes() -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes of the benched models (torch.nn.Linear weights are out x in)."""
    lm: list[tuple[int, ...]] = [(512, 128), (256, 128)]  # positions, token embeddings
    for _ in range(2):  # bench/torch_overhead.py's LM: two blocks of width 128
        lm += [(128,)] * 4  # two LayerNorms
        lm += _linear(128, 384) + _linear(128, 128) + _linear(128, 512) + _linear(512, 128)
    lm += [(128,), (128,), *_linear(128, 256)]
    mlp = _linear(512, 2048) + _linear(2048, 2048) * 2 + _linear(2048, 512)
    return {"toy (2 x Linear)": _linear(256, 512) + _linear(512, 256), "lm": lm, "mlp": mlp}


def best(run: Callable[[], object], repeat: int, steps: int) -> float:
    """The fastest of ``repeat`` blocks, in ms per call."""
    run()
    fastest = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        fastest = min(fastest, (time.perf_counter() - start) / steps)
    return fastest * 1e3


def measure(
    name: str, leaf_shapes: list[tuple[int, ...]], repeat: int, steps: int, rounds: int
) -> None:
    rng = np.random.default_rng(0)
    specs = [LeafSpec(f"p{i}", "float32", shape) for i, shape in enumerate(leaf_shapes)]
    probes = ProbeSet.create(specs, PROBE_RATIO, bytes(16))
    before = [
        probes.select(i, rng.standard_normal(shape).astype(np.float32) * np.float32(0.02))
        for i, shape in enumerate(leaf_shapes)
    ]
    updates = [(rng.standard_normal(r.shape) * 1e-4).astype(np.float32) for r in before]
    after = [r + u for r, u in zip(before, updates, strict=True)]

    def plain() -> None:
        for leaf, (pre, post) in enumerate(zip(before, after, strict=True)):
            matrix = probes.matrices[leaf]
            _ = (pre @ matrix, post @ matrix, (post - pre) @ matrix)

    def one_each() -> None:
        for leaf, (pre, post) in enumerate(zip(before, after, strict=True)):
            for rows in (pre, post, post - pre):
                probes.project_rows(leaf, rows)

    turn = {"forward": True}

    def per_step() -> None:
        # Steps go before -> after -> before...: every step's pre-update rows are the last
        # step's post-update rows, as in training, and no update is computed in the timing.
        rows = (before, after) if turn["forward"] else (after, before)
        turn["forward"] = not turn["forward"]
        probes.project_steps(*rows)

    projected = [
        np.concatenate([post, post - pre]) for pre, post in zip(before, after, strict=True)
    ]
    split = [exact_rows(rows)[0] for rows in projected]
    floor_blas = blas_floor(split, probes.matrices)
    floor_compiled = compiled_floor(split, probes.matrices)
    splitting = split_alone(projected)

    def numpy_path(run: Callable[[], object]) -> Callable[[], object]:
        def wrapped() -> object:
            os.environ[JIT_ENV] = "0"
            try:
                return run()
            finally:
                os.environ[JIT_ENV] = "1"

        return wrapped

    compiled = compiled_pass()
    runs: dict[str, Callable[[], object]] = {
        "float32 product": plain,
        "exact, one call per array": numpy_path(one_each),
        "exact, per step, numpy": numpy_path(per_step),
    }
    if compiled:
        runs["exact, per step, compiled"] = per_step
    runs["floor of exactness, BLAS"] = floor_blas
    if floor_compiled is not None:
        runs["floor of exactness, compiled"] = floor_compiled
    if splitting is not None:
        runs["the split alone, compiled"] = splitting
    # Interleaved rounds, the best of each: machine noise hits every variant alike.
    times: dict[str, float] = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for label, run in runs.items():
            times[label] = min(times[label], best(run, repeat, steps))
    rows = sum(len(r) for r in before)
    floats = sum(r.size for r in before)
    print(f"[{name}] {len(leaf_shapes)} leaves, {rows} probe rows, {floats:,} floats in them")
    reference = times["float32 product"]
    bottom = min(ms for label, ms in times.items() if label.startswith("floor"))
    for label, ms in times.items():
        print(
            f"  {label:<30} {ms:8.3f} ms/step  {ms / reference:5.2f} x float32 product  "
            f"{ms / bottom:5.2f} x the floor"
        )
    if compiled and splitting is not None:
        whole = bottom + times["the split alone, compiled"]
        print(
            f"  the floor with the split: {whole:.3f} ms/step; exact, per step, compiled = "
            f"{times['exact, per step, compiled'] / whole:.2f} x it"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = "compiled (Numba)" if compiled_pass() else "numpy only (Numba not installed)"
    print(f"exact probes: {path}; load average {os.getloadavg()[0]:.2f}")
    for name, leaf_shapes in shapes().items():
        measure(name, leaf_shapes, args.repeat, args.steps, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
