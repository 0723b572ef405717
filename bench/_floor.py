"""The least time ZKDV's default policy can add per step on the machine the benchmark runs on.

Under the default policy (check probability p, a snapshot every N steps) every step must
hash its whole post-update state, every N-th step copies the state to host memory, and a
sampled check replays from the latest snapshot through the checked step: (N + 1) / 2
training steps on average, so p (N + 1) / 2 steps of replay per step in expectation. When
the training step already keeps every core busy (a CPU machine; a GPU whose checks replay
on the GPU) none of this can hide behind the step, so their sum is a floor that no
implementation of the protocol goes below on that machine:

    floor = raw hash of the state + one state copy / N + p (N + 1) / 2 x the plain step

A run that commits its gradients (the cross-hardware protocol, DESIGN.md 4.1: every
Torch run, and a JAX run whose step calls ``TrainState.apply_gradients``) also hashes
each step's gradient and writes it to the step's file for the platform's replay, so its
floor adds a hash and a copy (into the page cache) of the gradient's bytes:

    + raw hash of the gradient + one gradient copy

A framework that runs the step as compiled programs (JAX) pays for the protocol in those
programs too: the gradient is an output, and the canonical update a second program that
writes the optimizer state into fresh buffers (the contract forbids donating it). A
benchmark that times the committed programs alone, without any commitment, passes their
added time per step as ``programs_ms``: the floor of the whole protocol is then that plus
the check-free floor above, and ZKDV's host work is what the step adds beyond the
programs.

Every step record also carries exact probes of the post-update, delta and gradient rows
(``zkdv.probes``), which no implementation of the protocol can skip either. Their floor
of exactness (:func:`probe_floor_ms`, ``bench/probe_cost.py``'s: the integer slices' products
alone, split beforehand, the faster of a BLAS and the compiled pass's dot products) is single-threaded work; spread
over every core it adds ``probe_floor / cores`` to the protocol's floor, as the hash
counts BLAKE3 over all threads.

Measured in the same run as the benchmark, so the printed floor and the measured overhead
see the same machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["floor_lines", "probe_floor_ms"]


def probe_floor_ms(leaves: Sequence[np.ndarray], probe_ratio: float, arrays: int = 3) -> float:
    """The floor of exactness of one step's probes, in ms on one core: the faster of
    the BLAS products and the compiled pass's dot products (``bench/probe_cost.py``).

    ``leaves`` are the committed parameters; each step projects ``arrays`` sets of every
    leaf's probed rows (post-update, delta and, with committed gradients, gradient).
    """
    from probe_cost import best, blas_floor, compiled_floor  # bench/ is on sys.path

    from zkdv.merkle import LeafSpec
    from zkdv.probes import ProbeSet, exact_rows

    values = [np.asarray(leaf) for leaf in leaves]
    specs = [LeafSpec.of(f"p{i}", leaf) for i, leaf in enumerate(values)]
    probes = ProbeSet.create(specs, probe_ratio, bytes(16))
    rows = [probes.select(index, leaf) for index, leaf in enumerate(values)]
    kept = [index for index, selected in enumerate(rows) if selected.size]
    split = [exact_rows(np.concatenate([rows[index]] * arrays))[0] for index in kept]
    matrices = [probes.matrices[index] for index in kept]
    # The faster of the two, as bench/probe_cost.py's floor.
    runs = [blas_floor(split, matrices), compiled_floor(split, matrices)]
    return min(best(run, repeat=5, steps=1) for run in runs if run is not None)


def _copy_ms(flat: np.ndarray) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        flat.copy()  # a snapshot copies into fresh host memory
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def floor_lines(
    flat: np.ndarray,
    *,
    plain_ms: float,
    hash_ms: float,
    added_ms: float,
    probability: float = 0.01,
    interval: int = 12,
    gradient_bytes: int = 0,
    programs_ms: float | None = None,
    probes_ms: float | None = None,
    measured: str = "the median block rarely holds a check",
) -> list[str]:
    """Report lines comparing the measured added time with the floor (see module doc).

    ``flat`` is the committed state's bytes and ``hash_ms`` their raw hash; a run that
    commits gradients passes their size as ``gradient_bytes`` (at most the state's: the
    gradient is the parameters' shape); ``programs_ms``: see the module doc;
    ``probes_ms``: :func:`probe_floor_ms`, counted in the protocol's floor;
    ``measured`` says which blocks ``added_ms`` comes from.
    """
    copy_ms = _copy_ms(flat)
    commit = hash_ms + copy_ms / interval
    gradient = ""
    if gradient_bytes:
        hashed = hash_ms * gradient_bytes / flat.nbytes  # BLAKE3 is linear in the bytes
        written = _copy_ms(flat[:gradient_bytes])
        commit += hashed + written
        gradient = f" + gradient hash {hashed:.1f} + gradient file copy {written:.1f}"
    replay_ms = probability * (interval + 1) / 2 * plain_ms
    floor = commit + replay_ms
    lines = [
        f"  floor here: hash {hash_ms:.1f}{gradient} + snapshot copy {copy_ms:.1f}/{interval} "
        f"= {commit:.1f} ms/step ({commit / hash_ms:.2f} x raw blake3, step-time ratio "
        f"{(plain_ms + commit) / plain_ms:.3f}) in a step without a check;",
        f"    plus the expected check replay, {probability:g} x {(interval + 1) / 2:g} steps "
        f"= {replay_ms:.1f} ms/step: {floor:.1f} ms/step = {floor / hash_ms:.2f} x raw "
        f"blake3, step-time ratio {(plain_ms + floor) / plain_ms:.3f}",
        f"  measured added {added_ms:.1f} ms/step = {added_ms / commit:.2f} x the check-free "
        f"floor ({measured})",
    ]
    if programs_ms is not None:
        cores = len(os.sched_getaffinity(0))
        probes = 0.0 if probes_ms is None else probes_ms / cores
        whole = programs_ms + commit + probes
        host = added_ms - programs_ms
        if probes_ms is not None:
            lines.append(
                f"  the step's exact probes, floor of exactness: {probes_ms:.1f} ms on one "
                f"core = {probes:.1f} ms/step over {cores} cores"
            )
        counted = " + the probes' floor" if probes_ms is not None else ""
        lines += [
            f"  the committed programs alone add {programs_ms:.1f} ms/step: the protocol's "
            f"check-free floor here (with hashing and copies{counted}) is {whole:.1f} "
            f"ms/step, measured added = {added_ms / whole:.2f} x it;",
            f"    ZKDV's host work (the step beyond its programs) {host:.1f} ms/step = "
            f"{host / (commit + probes):.2f} x the check-free floor of hashing and "
            f"copies{counted}",
        ]
    return lines
