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

Measured in the same run as the benchmark, so the printed floor and the measured overhead
see the same machine.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["floor_lines"]


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
) -> list[str]:
    """Report lines comparing the measured added time with the floor (see module doc).

    ``flat`` is the committed state's bytes and ``hash_ms`` their raw hash; a run that
    commits gradients passes their size as ``gradient_bytes`` (at most the state's: the
    gradient is the parameters' shape); ``programs_ms``: see the module doc.
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
        "floor (the median block rarely holds a check)",
    ]
    if programs_ms is not None:
        whole = programs_ms + commit
        host = added_ms - programs_ms
        lines += [
            f"  the committed programs alone add {programs_ms:.1f} ms/step: the protocol's "
            f"check-free floor here is {whole:.1f} ms/step, measured added = "
            f"{added_ms / whole:.2f} x it;",
            f"    ZKDV's host work (the step beyond its programs) {host:.1f} ms/step = "
            f"{host / commit:.2f} x the check-free floor of hashing and copies",
        ]
    return lines
