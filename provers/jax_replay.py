"""The ``whitebox-jax`` prover: replay challenged steps with the committed ``jax.export`` programs.

The transition comes from the SDK's public replay module, :mod:`zkdv.jax.replay` (the
committed production and apply programs, as the SDK's own sampled checks run them);
this module adds the platform's policy: where a replay must be bit for bit
(:func:`exact_environment`) and what the certificate states about the worker
(:func:`environment`).

A run that commits its gradients (artifact version 2, root ``schema.grad``) trained
with the very programs the replay runs: the production step computes the gradient and
the carried state, the apply program the canonical optimizer update on them. On other
hardware the recomputed gradient is judged by the run's gradient bounds and the state
must still hash to the committed roots exactly; an older run (version 1) replays its
exported transition and is judged by the probes within the run's ``FloatTolerance``.

Exactness (:func:`exact_environment`): one compiled program gives the same bits only
on the same backend and device kinds, XLA build, CPU (model, features and the
instruction set XLA compiles for: ``--xla_cpu_max_isa`` caps it), thread count (the
CPUs the process may run on: XLA's CPU thread pool is sized by them, and a reduction
splits with it), ``XLA_FLAGS``, 64-bit mode and default matmul precision; the root
records them all (``env``). Where they all match, a replay that reproduces a step only
within bounds or tolerance is itself a mismatch (``exact=True``): that is what catches a
change the bounds or the probes cannot see. A version-1 run exported for several
platforms trained with another program than its replay runs (the multi-platform
lowering simplifies the module differently), so it is never claimed exact.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from provers import judge
from provers.replay import ReplayVerdict, Transcript, replay
from zkdv.environments import differences, exact_keys
from zkdv.jax import replay as frontend
from zkdv.jax.replay import PROGRAM_KINDS, PROVER, load_transition
from zkdv.replay import ReplayError, Transition

__all__ = [
    "EXACT_KEYS",
    "PROGRAM_KINDS",
    "PROVER",
    "environment",
    "environment_differences",
    "exact_environment",
    "load_transition",
    "verify_challenge",
]

#: The root's ``env`` entries that change a JAX program's bits on a CPU (module
#: docstring); on an accelerator its runtime's too (:func:`zkdv.environments.replay_environment`
#: is the one definition).
EXACT_KEYS = exact_keys(PROVER)
#: What the certificate states of a worker besides those: its platform kind, chip and
#: accelerator runtime.
_STATED = ("platform_kind", "device_kind", "platform_version", "libtpu", "libtpu_init_args")


def environment() -> dict[str, Any]:
    """Where this worker replays (:data:`EXACT_KEYS`, its platform kind, chip and
    accelerator runtime, as the SDK records them): what the certificate states beside
    the run's own environment, and what :func:`exact_environment` compares."""
    values = frontend.environment()
    return {key: values.get(key) for key in (*EXACT_KEYS, *_STATED)}


def environment_differences(root: dict[str, Any]) -> list[str]:
    """The replay-environment keys (:func:`zkdv.environments.replay_environment`) in which
    this worker differs from the run: empty where a replay here is bit for bit."""
    # The root of a run this prover replays names it (``load_artifact`` checks).
    return differences({**root, "prover": PROVER}, {"prover": PROVER, "env": environment()})


def exact_environment(root: dict[str, Any]) -> bool:
    """Whether this process runs the committed programs exactly as the run did.

    Compares the run's replay environment key with this process's
    (:func:`environment_differences`: a root that lacks an entry, written before it was
    recorded, is never exact), and requires one unsharded process, programs exported for
    this backend and, for a run without committed gradients, exported for the training
    platform alone (module docstring).
    """
    env = root.get("env") or {}
    # The replay runs the exported program on one device: a run whose state was sharded
    # over several devices (or processes) reduced in another order.
    sharded = bool((root.get("schema") or {}).get("sharding"))
    if sharded or env.get("process_count", 1) != 1:
        return False
    if environment_differences(root):
        return False
    platforms = env.get("export_platforms")
    backend = jax.default_backend()
    if not isinstance(platforms, list) or backend not in platforms:
        return False
    return "grad" in (root.get("schema") or {}) or platforms == [backend]


def verify_challenge(
    proof_dir: str | os.PathLike[str],
    step: int,
    *,
    through: int | None = None,
    transition: Transition | None = None,
    exact: bool | None = None,
) -> ReplayVerdict:
    """Replay a challenged step (or a window through ``through``) of a JAX proof.

    Args:
        proof_dir: the proof directory.
        step: the challenged step.
        through: replay on to this step; from a snapshot to the step before the next
            snapshot checks a whole window.
        transition: a transition already loaded by :func:`load_transition` for this
            proof (skips the one-time artifact load and compilation).
        exact: demand bit-exact state roots (and gradients) at every step; by default,
            exactly when :func:`exact_environment` holds.

    Returns:
        The verdict, with per-step evidence and the worker's environment; failures
        carry a reason (``program_mismatch``, ``snapshot_mismatch``, ``batch_mismatch``,
        ``replay_mismatch``, ``missing_file``, ``invalid_transcript``, ...).
    """
    try:
        transcript = Transcript.load(proof_dir)
        if transition is None:
            transition = load_transition(proof_dir)
    except ReplayError as error:
        return ReplayVerdict(ok=False, step=step, reason=error.reason, message=error.message)
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
