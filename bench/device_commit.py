"""Device-side commitments versus the host path and the memory floor, side by side in one run.

    python bench/device_commit.py [--mib 256] [--repeat 5] [--chunk-bytes 1048576]
    python bench/device_commit.py --gpu-check        # a GPU machine, unattended, < 8 min

For one state of ``--mib`` MiB (a model-like mix of large float32 and bfloat16 leaves and
small ones) on whatever backend is present, in the same run:

* **device hash**: ``zkdv.jax.device_merkle.chunk_roots`` (every schedule that compiles in
  reasonable time on the backend) and, when Torch is importable, the Torch kernels;
* **raw host blake3** over the same bytes, all threads (``max_threads=AUTO``), and the
  host path's ``commit_state``;
* **the floor**: a plain device read of the same bytes (a jitted sum over every leaf),
  and the device-to-host copy the host path makes every step.

Every device result is also compared with the host's roots (bit-identical or the script
fails). Ratios are printed against the floor: the issue's goal on a GPU is device
hashing in at most 1.5x one HBM read of the committed state.

``--gpu-check`` (for a GPU machine; at most 465 s in all, under 8 minutes): runs the
device tests (``tests/agent/zkdv/jax/test_device_commit.py``, ``test_jax_device_path.py``,
``tests/agent/zkdv/torch/test_device_kernels.py``, ``tests/agent/zkdv/test_device_merkle.py``,
``tests/agent/zkdv/test_probes.py``), ``bench/jax_overhead.py --quick`` (LM and the
state-heavy MLP; JAX takes the device path by default there),
``bench/torch_overhead.py --quick`` (LM and MLP) and ``--recipe lm --quick`` (the
default policy and p = 0 side by side, with their difference), ``bench/probe_cost.py``
(exact probes against their floor), this benchmark at 4 GiB, then at 1 GiB with the
Torch kernels also through ``torch.compile``; each part under its own time limit, cut to
what is left of the whole, so one that hangs costs only its own part.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from zkdv.merkle import commit_state

ROOT = Path(__file__).resolve().parent.parent


def state_leaves(mib: float, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """A model-like state: four large matrices, bfloat16 copies, vectors, a step count."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    total = int(mib * 2**20)
    leaves = []
    for i, share in enumerate((0.3, 0.25, 0.2, 0.1)):
        rows = max(1, int(total * share) // (4 * 1024))
        leaves.append((f"w{i}", rng.random((rows, 1024), dtype=np.float32) - np.float32(0.5)))
    rows = max(1, int(total * 0.1) // (2 * 1024))
    emb = (rng.random((rows, 1024), dtype=np.float32) - np.float32(0.5)).astype(ml_dtypes.bfloat16)
    leaves.append(("emb_bf16", emb))
    for i in range(20):
        leaves.append((f"b{i}", rng.standard_normal(1024 + 3 * i, dtype=np.float32)))
    leaves.append(("step", np.array(12, np.int32)))
    return leaves


def best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:8.2f} GB/s {seconds * 1e3:9.2f} ms"


def run_jax(leaves: list[tuple[str, np.ndarray]], args: argparse.Namespace, host: Any) -> None:
    import jax
    import jax.numpy as jnp

    from zkdv.device_merkle import roots_to_bytes
    from zkdv.jax.device_merkle import (
        BLOCKWISE,
        COMPACT,
        FUSED,
        KERNEL,
        Schedule,
        chunk_roots,
        default_schedule,
    )

    backend = jax.default_backend()
    nbytes = sum(a.nbytes for _, a in leaves)
    arrays = [jax.device_put(a) for _, a in leaves]
    jax.block_until_ready(arrays)
    print(f"\n[jax {jax.__version__} on {backend}: {jax.devices()[0].device_kind}]")
    read = jax.jit(lambda xs: sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in xs))
    jax.block_until_ready(read(arrays))
    floor = best(lambda: jax.block_until_ready(read(arrays)), args.repeat)
    print(f"  plain device read (floor)      {gbs(nbytes, floor)}")
    copy = best(lambda: jax.device_get(arrays), max(1, args.repeat // 2))
    print(f"  device-to-host copy (host path){gbs(nbytes, copy)}  = {copy / floor:6.2f} x floor")
    schedules = [("compact", COMPACT)]
    if backend != "cpu":
        schedules = [
            ("kernel", KERNEL),
            ("blockwise", BLOCKWISE),
            ("fused", FUSED),
            ("fused, looped levels", Schedule(unroll=True, exact_levels=False)),
            ("compact", COMPACT),
        ]
    if backend != "tpu":  # Pallas's TPU kernels run here only through its interpreter
        schedules = [(n, s) for n, s in schedules if not s.kernel]
    schedules = [(f"{n} (default)" if s == default_schedule() else n, s) for n, s in schedules]
    for name, schedule in schedules:
        start = time.perf_counter()
        try:
            roots = jax.device_get(chunk_roots(arrays, args.chunk_bytes, schedule=schedule))
        except Exception as error:  # noqa: BLE001 - report and go on to the next schedule
            print(f"  device hash ({name}): failed: {type(error).__name__}: {error}")
            continue
        compiled = time.perf_counter() - start
        same = roots_to_bytes(roots) == list(host.chunk_roots)
        seconds = best(
            lambda s=schedule: jax.block_until_ready(
                chunk_roots(arrays, args.chunk_bytes, schedule=s)
            ),
            args.repeat,
        )
        print(
            f"  device hash ({name:20s}) {gbs(nbytes, seconds)}  = {seconds / floor:6.2f} x floor"
            f"  (first call {compiled:.1f} s; roots {'identical' if same else 'DIFFER'})"
        )
        if not same:
            raise SystemExit("device roots differ from the host's")
    probe_arrays = [a for a in arrays if a.ndim == 2]
    from zkdv.jax.device_probes import DeviceProbes
    from zkdv.merkle import LeafSpec
    from zkdv.probes import ProbeSet

    specs = [
        LeafSpec(str(i), str(np.dtype(a.dtype).name), a.shape) for i, a in enumerate(probe_arrays)
    ]
    probes = DeviceProbes(ProbeSet.create(specs, 0.01, bytes(16)))
    jax.block_until_ready(probes(probe_arrays))
    seconds = best(lambda: jax.block_until_ready(probes(probe_arrays)), args.repeat)
    print(f"  device probes (64 rows x 1%)   {seconds * 1e3:9.2f} ms")


def run_torch(leaves: list[tuple[str, np.ndarray]], args: argparse.Namespace, host: Any) -> None:
    try:
        import torch
    except ImportError:
        print("\n[torch not installed: skipped]")
        return
    from zkdv.torch.device_merkle import chunk_roots, roots_bytes

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and sum(a.nbytes for _, a in leaves) > 16 << 20:
        # Eager Torch on CPU runs every operation as its own kernel: hash a smaller state.
        leaves = state_leaves(8)
        host = commit_state(leaves, args.chunk_bytes)
    nbytes = sum(a.nbytes for _, a in leaves)

    def tensor(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    tensors = [tensor(a) for _, a in leaves]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    print(f"\n[torch {torch.__version__} on {device}; {nbytes / 2**20:.0f} MiB]")
    floor = best(lambda: ([t.sum() for t in tensors], sync()), args.repeat)
    print(f"  plain device read (floor)      {gbs(nbytes, floor)}")
    modes = [("eager", False)] + ([("compiled", True)] if args.torch_compiled else [])
    for name, compiled in modes:
        start = time.perf_counter()
        roots = roots_bytes(chunk_roots(tensors, args.chunk_bytes, compiled=compiled))
        first = time.perf_counter() - start
        same = roots == list(host.chunk_roots)
        seconds = best(
            lambda c=compiled: (chunk_roots(tensors, args.chunk_bytes, compiled=c), sync()),
            max(1, args.repeat // 2),
        )
        print(
            f"  device hash ({name:20s}) {gbs(nbytes, seconds)}  = {seconds / floor:6.2f} x floor"
            f"  (first call {first:.1f} s; roots {'identical' if same else 'DIFFER'})"
        )
        if not same:
            raise SystemExit("Torch device roots differ from the host's")


def bench(args: argparse.Namespace) -> None:
    leaves = state_leaves(args.mib)
    nbytes = sum(a.nbytes for _, a in leaves)
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for _, a in leaves])
    print(
        f"state {nbytes / 2**20:.0f} MiB in {len(leaves)} leaves, chunk {args.chunk_bytes} B, "
        f"{os.cpu_count()} cpus; best of {args.repeat}"
    )
    host = commit_state(leaves, args.chunk_bytes)
    raw = best(
        lambda: blake3.blake3(memoryview(flat), max_threads=blake3.blake3.AUTO).digest(),
        args.repeat,
    )
    commit = best(lambda: commit_state(leaves, args.chunk_bytes), args.repeat)
    print(f"  raw host blake3, all threads   {gbs(nbytes, raw)}")
    print(f"  host commit_state              {gbs(nbytes, commit)}")
    run_jax(leaves, args, host)
    if not args.no_torch:
        run_torch(leaves, args, host)


#: The whole --gpu-check, in seconds: under 8 minutes with the interpreter's start-up.
GPU_CHECK_SECONDS = 465


def _run(command: list[str], limit: int, deadline: float | None = None) -> int:
    """Run one part under ``limit`` seconds, cut to what is left before ``deadline``."""
    if deadline is not None:
        left = int(deadline - time.monotonic())
        if left < 10:
            print(f"\n$ {' '.join(command)}   skipped: the check's time is spent", flush=True)
            return 124
        limit = min(limit, left)
    print(f"\n$ {' '.join(command)}   (limit {limit} s)", flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'agent' / 'zkdv' / 'src'}:{ROOT / 'agent' / 'dvbench' / 'src'}:{ROOT}",
    }
    try:
        return subprocess.run(command, cwd=ROOT, env=env, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        print(f"  ... stopped after {limit} s")
        return 124


def gpu_check(args: argparse.Namespace) -> int:
    python = sys.executable
    deadline = time.monotonic() + GPU_CHECK_SECONDS
    parts: list[tuple[list[str], int]] = [
        (
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-x",
                "tests/agent/zkdv/jax/test_device_commit.py",
                "tests/agent/zkdv/jax/test_jax_device_path.py",
                "tests/agent/zkdv/torch/test_device_kernels.py",
                "tests/agent/zkdv/test_device_merkle.py",
                "tests/agent/zkdv/test_probes.py",
            ],
            120,
        ),
        # The step overhead: JAX LM and the state-heavy MLP (device path by default),
        # Torch LM and MLP, the Torch LM recipe (bf16 autocast, accumulation, clipping,
        # schedule) with the default policy and p = 0 side by side, and exact probes
        # against their floor (host work: the same on any machine).
        ([python, "bench/jax_overhead.py", "--quick"], 75),
        ([python, "bench/torch_overhead.py", "--quick"], 50),
        ([python, "bench/torch_overhead.py", "--recipe", "lm", "--quick"], 60),
        ([python, "bench/probe_cost.py", "--repeat", "3", "--steps", "10", "--rounds", "2"], 20),
        ([python, __file__, "--mib", "4096", "--repeat", "3"], 65),
        # Last: the Inductor compile of the Torch kernels may not finish in its time.
        ([python, __file__, "--mib", "1024", "--repeat", "3", "--torch-compiled"], 70),
    ]
    failures = sum(bool(_run(command, limit, deadline)) for command, limit in parts)
    print(f"\ngpu-check: {failures} part(s) failed, timed out or skipped")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--torch-compiled", action="store_true", help="also torch.compile the Torch kernels"
    )
    parser.add_argument("--gpu-check", action="store_true", help="tests + benchmarks on a GPU")
    args = parser.parse_args()
    if args.gpu_check:
        raise SystemExit(gpu_check(args))
    bench(args)


if __name__ == "__main__":
    main()
