"""Commitment throughput over a large state, side by side with raw BLAKE3 and a memory copy.

    python bench/commit_throughput.py [--gib 1.0] [--chunk-bytes 1048576] [--repeat 3]

Prints, for the same bytes in the same run: ``commit_state`` (chunked Merkle tree,
domain-separated, multi-threaded), raw ``blake3`` with all threads (``max_threads=AUTO``),
and ``numpy.copyto`` into a preallocated buffer; then the ratios. The target is
commitment throughput >= 0.85 of raw blake3. Best of ``--repeat`` runs each, interleaved
so that thermal or neighbour noise hits all three alike.

Then a step's batch commitment (``commit_batch``: row hashes and the sorted multiset of
rolling-window fingerprints) for bench/jax_overhead.py's MLP batch (64 rows of 1,536
words), the LM recipe's (16 rows of 513 tokens) and two long-context batches, with the
share of it that the sorted fingerprints take, median of 50 calls each (10 for the
largest).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import blake3
import numpy as np

from zkdv import batch as batch_module
from zkdv.merkle import commit_state


def _best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    # A realistic state: a few big matrices and many small leaves.
    rng = np.random.default_rng(0)
    big = total // 4 // 8 * 8
    leaves = [
        (f"layer{i}/kernel", rng.integers(0, 2**31, size=big // 4, dtype=np.int32).view(np.float32))
        for i in range(4)
    ]
    leaves += [(f"layer{i}/bias", rng.standard_normal(1024).astype(np.float32)) for i in range(64)]
    nbytes = sum(a.nbytes for _, a in leaves)
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for _, a in leaves])
    target = np.empty_like(flat)

    times = {"commit": [], "blake3": [], "copy": []}
    for _ in range(args.repeat):
        times["commit"].append(_best(lambda: commit_state(leaves, args.chunk_bytes), 1))
        times["blake3"].append(
            _best(
                lambda: blake3.blake3(memoryview(flat), max_threads=blake3.blake3.AUTO).digest(), 1
            )
        )
        times["copy"].append(_best(lambda: np.copyto(target, flat), 1))
    best = {k: min(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    print(
        f"machine: {os.cpu_count()} cpus; state {nbytes / 2**30:.2f} GiB in {len(leaves)} leaves; chunk {args.chunk_bytes} bytes"
    )
    for name in ("commit", "blake3", "copy"):
        print(f"  {name:7s} {best[name] * 1e3:8.1f} ms  {gbps[name]:6.2f} GB/s")
    print(
        f"ratio commit/raw-blake3 throughput: {best['blake3'] / best['commit']:.3f}  (target >= 0.85)"
    )
    print(f"ratio commit/memcpy throughput:     {best['copy'] / best['commit']:.3f}")
    _batches()


def _batches() -> None:
    rng = np.random.default_rng(1)
    shapes = (
        ("MLP batch", (64, 1536)),
        ("LM batch", (16, 513)),
        ("8k context", (32, 8192)),
        ("8k context, 256 rows", (256, 8192)),
    )
    for name, shape in shapes:
        words = rng.integers(0, 2**32, shape, dtype=np.uint32)
        calls = {
            "commit_batch": functools.partial(batch_module.commit_batch, words, 4),
            "sorted": functools.partial(batch_module.sorted_fingerprints, words, 4),
        }
        times: dict[str, list[float]] = {call: [] for call in calls}
        for _ in range(10 if shape[0] > 64 else 50):
            for call, fn in calls.items():
                times[call].append(_best(fn, 1))
        ms = {call: statistics.median(values) * 1e3 for call, values in times.items()}
        print(
            f"{name} ({shape[0]} x {shape[1]} words, window 4): commit_batch "
            f"{ms['commit_batch']:.2f} ms, of which the sorted fingerprints "
            f"{ms['sorted']:.2f} ms ({ms['sorted'] / ms['commit_batch']:.0%})"
        )


if __name__ == "__main__":
    main()
