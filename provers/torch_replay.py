"""The ``whitebox-torch`` prover: replay challenged steps with the sealed Torch program.

The transition comes from the SDK's public replay module, :mod:`zkdv.torch.replay`
(the sealed gradient program and the recorded optimizer, as the SDK's own sampled checks
run them); this module adds the platform's policy: where a replay must be bit for bit
(:func:`exact_environment`) and the thread count and matmul precision it runs under.

Exactness: training runs eager autograd; a ``torch.export`` program replays the same
ATen kernels, so on the recorded Torch version, device kind, CPU kernel family and
thread count (the replay runs with ``env.threads`` threads) it reproduces the committed
gradient and state bit for bit, and :func:`verify_challenge` demands that. Elsewhere (an
AOT Inductor program, another CPU kernel family or GPU) a run that commits its gradients
is judged by the gradient bounds, and its state still exactly; an older run by the
probes within the run's ``FloatTolerance``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from provers import judge
from provers.replay import ReplayVerdict, Transcript, replay
from zkdv.environments import differences
from zkdv.replay import ReplayError, Transition
from zkdv.torch.replay import PROGRAM_KINDS, PROVER, TORCH_EXPORT, load_transition

__all__ = [
    "PROGRAM_KINDS",
    "PROVER",
    "environment",
    "environment_differences",
    "exact_environment",
    "load_transition",
    "verify_challenge",
]

_CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()


def environment_differences(root: dict[str, Any]) -> list[str]:
    """The replay-environment keys (:func:`zkdv.environments.replay_environment`: Torch
    version, platform kind, device kind, CPU kernel family) in which this worker differs
    from the run. A root from before ``cpu_capability`` was recorded is assumed to match."""
    env = dict(root.get("env") or {})
    env.setdefault("cpu_capability", _CPU_CAPABILITY)
    return differences(
        {**root, "prover": PROVER, "env": env}, {"prover": PROVER, "env": environment()}
    )


def exact_environment(root: dict[str, Any]) -> bool:
    """Whether a replay here reproduces the committed roots bit for bit.

    True for a ``torch.export`` program (eager kernels, like training) in the run's
    replay environment (:func:`environment_differences` is empty: the recorded Torch
    version, a CPU run and the same CPU kernel family); an AOT Inductor program never
    matches eager training, and an FSDP2 run (``env["fsdp"]`` names its mesh) is never
    claimed bit-exact: its committed gradient is reduce-scattered across ranks, which
    rounds differently from one process's backward over the whole batch. Its gradient
    is judged within the run's bounds; its state, the canonical update of the committed
    gradient, is still required bit for bit.
    """
    env = root.get("env") or {}
    program = root.get("program") or {}
    return (
        program.get("kind") == TORCH_EXPORT
        and not environment_differences(root)
        and not env.get("fsdp")
    )


def environment() -> dict[str, Any]:
    """Where this worker replays: what the certificate states beside the run's own."""
    return {
        "torch": torch.__version__,
        "platform_kind": "cpu",
        "device_kind": "cpu",
        "cpu_capability": _CPU_CAPABILITY,
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def _threads(count: Any, precision: Any = None) -> Iterator[None]:
    """Run with the training's intra-op thread count and float32 matmul precision.

    CPU reductions are split by the thread count, and a lower matmul precision lets
    oneDNN use reduced-precision kernels: both change the bits.
    """
    previous = torch.get_num_threads()
    previous_precision = torch.get_float32_matmul_precision()
    wanted = count if isinstance(count, int) and count > 0 else previous
    torch.set_num_threads(wanted)
    if precision in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        torch.set_float32_matmul_precision(previous_precision)


def verify_challenge(
    proof_dir: str | os.PathLike[str],
    step: int,
    *,
    through: int | None = None,
    transition: Transition | None = None,
    exact: bool | None = None,
) -> ReplayVerdict:
    """Replay a challenged step (or a window through ``through``) of a Torch proof.

    Args:
        proof_dir: the proof directory.
        step: the challenged step.
        through: replay on to this step (a whole window).
        transition: a transition already loaded by :func:`load_transition` for this
            proof (skips the one-time artifact load).
        exact: demand bit-exact state roots at every step; by default, exactly when
            :func:`exact_environment` holds.

    Returns:
        The verdict, with per-step evidence and a reason on failure.
    """
    try:
        transcript = Transcript.load(proof_dir)
        if transition is None:
            transition = load_transition(proof_dir)
    except ReplayError as error:
        return ReplayVerdict(ok=False, step=step, reason=error.reason, message=error.message)
    env = transcript.root.get("env") or {}
    with _threads(env.get("threads"), env.get("float32_matmul_precision")):
        verdict = replay(transcript, step=step, through=through, transition=transition)
        verdict.environment = environment()
    if exact is None:
        exact = exact_environment(transcript.root)
    return judge(
        verdict,
        environment_differences(transcript.root),
        exact=exact,
        gradient_files=transcript.keeps_gradient_files,
    )
