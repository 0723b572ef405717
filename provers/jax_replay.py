"""The ``whitebox-jax`` prover: replay challenged steps with the committed ``jax.export`` program.

The attested artifact (``program.jaxexport``, ``docs/jax.md`` section 5) holds a
``transition`` program ``(params, opt_state, batch) -> (deltas, params_after,
opt_state_after)`` over flat tuples of leaves in the transcript's schema order, and the
packed-batch layout it unpacks. :func:`load_transition` checks that the file hashes to
the root record's program digest, decodes it with :class:`zkdv.jax.artifact.Artifact`
(the SDK's own reader) and wraps ``transition`` as a :data:`provers.replay.Transition`;
:func:`verify_challenge` hands it to the framework-neutral :func:`provers.replay.replay`.

The transition is always *one* update: for a run that made several updates per call
(``zkdv.jax.scan``) it is one iteration of the scan body, and each update has its own
step record and batch file, so windows replay step by step as for any run; a Flax NNX
run's transition is its whole step, over the same flat schema.

Exactness: the training step and the exported transition are different XLA programs,
but XLA compiles the same arithmetic for both on the same backend, so a replay on the
platform, library versions and core count the run recorded (``env.jax_platform``,
``env.jaxlib``, ``env.devices``, ``env.cpu_count``) reproduces the committed state roots bit for bit. There a replay that
matches only within the probes' tolerance is itself a mismatch (``exact=True``): that is
what catches a change confined to coordinates the probes cannot see. Elsewhere (another
accelerator, another XLA) the probes and ``FloatTolerance`` decide.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from provers import program_material, require_exact, root_record
from provers.replay import Leaves, ReplayError, ReplayVerdict, Transcript, Transition, replay
from zkdv.jax.artifact import Artifact

__all__ = ["PROGRAM_KINDS", "PROVER", "exact_environment", "load_transition", "verify_challenge"]

PROVER = "whitebox-jax"
PROGRAM_KINDS = ("jax.export",)


def _specs_match(artifact_specs: list[dict[str, Any]], schema: list[dict[str, Any]]) -> bool:
    def key(spec: dict[str, Any]) -> tuple[str, str, tuple[int, ...]]:
        return str(spec["path"]), str(np.dtype(spec["dtype"])), tuple(spec["shape"])

    return [key(s) for s in artifact_specs] == [key(s) for s in schema]


def load_transition(proof_dir: str | os.PathLike[str]) -> Transition:
    """Load the committed program of a ``whitebox-jax`` proof as a state transition.

    Args:
        proof_dir: the proof directory (``records.cborl`` and ``program.jaxexport``).

    Returns:
        ``(params, opt_state, buffers, batch) -> (params, opt_state, buffers, deltas)``
        running the artifact's ``transition`` program (compiled once, on first use).

    Raises:
        provers.replay.ReplayError: ``program_mismatch`` when the artifact does not hash
            to the committed digest, is not a ZKDV JAX artifact, or was exported for
            another state schema; ``unsupported_program`` when it has no transition.
    """
    root = root_record(proof_dir)
    if root.get("prover") != PROVER:
        raise ReplayError(
            "program_mismatch", f"the proof names prover {root.get('prover')!r}, not {PROVER!r}"
        )
    _, material = program_material(proof_dir, root, PROGRAM_KINDS)
    try:
        artifact = Artifact.loads(material)
    except (ValueError, KeyError) as error:
        raise ReplayError("program_mismatch", f"program.jaxexport is unreadable: {error}") from None
    schema = root["schema"]
    if not (
        _specs_match(artifact.params, schema["params"])
        and _specs_match(artifact.opt_state, schema["opt_state"])
    ):
        raise ReplayError(
            "program_mismatch",
            "the program artifact was exported for another parameter or optimizer-state schema",
        )
    if artifact.transition is None:
        raise ReplayError(
            "unsupported_program",
            "the artifact has no transition program (an explicit proof.attest run "
            "without zkdv.jax.index); only a snapshot step can be checked, by the SDK",
        )
    # One compilation per loaded artifact; later calls reuse the executable.
    program = jax.jit(artifact.transition.call)
    param_paths = [str(s["path"]) for s in schema["params"]]
    opt_paths = [str(s["path"]) for s in schema["opt_state"]]

    def transition(
        params: Leaves, opt_state: Leaves, buffers: Leaves, batch: np.ndarray, step: Any = None
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        # Every input a JAX step reads is in the batch or the state: ``step`` is unused.
        deltas, params_after, opt_after = program(
            tuple(a for _, a in params),
            tuple(a for _, a in opt_state),
            np.asarray(batch, dtype=np.uint32),
        )
        return (
            list(zip(param_paths, (np.asarray(a) for a in params_after), strict=True)),
            list(zip(opt_paths, (np.asarray(a) for a in opt_after), strict=True)),
            list(buffers),  # JAX states carry no separate buffers tree
            list(zip(param_paths, (np.asarray(a) for a in deltas), strict=True)),
        )

    return Transition(transition)


def exact_environment(root: dict[str, Any]) -> bool:
    """Whether this process replays on the backend, XLA build and core count the run recorded.

    XLA's CPU thread pool is sized by the core count, and its reductions may split
    differently with another pool: the recorded ``cpu_count`` must match too. A run
    sharded over several devices or processes is never replayed exactly.
    """
    import jaxlib

    env = root.get("env") or {}
    # The replay runs the exported program on one device: a run whose state was sharded
    # over several devices (or processes) reduced in another order.
    sharded = bool((root.get("schema") or {}).get("sharding"))
    return (
        not sharded
        and env.get("process_count", 1) == 1
        and env.get("jax_platform") == jax.default_backend()
        and env.get("cpu_count") == (os.cpu_count() or 1)
        and env.get("jaxlib") == getattr(jaxlib, "__version__", "unknown")
        and env.get("devices") == sorted({device.device_kind for device in jax.devices()})
    )


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
        exact: demand bit-exact state roots at every step; by default, exactly when
            :func:`exact_environment` holds.

    Returns:
        The verdict, with per-step evidence; failures carry a reason
        (``program_mismatch``, ``snapshot_mismatch``, ``batch_mismatch``,
        ``replay_mismatch``, ``missing_file``, ``invalid_transcript``, ...).
    """
    try:
        transcript = Transcript.load(proof_dir)
        if transition is None:
            transition = load_transition(proof_dir)
    except ReplayError as error:
        return ReplayVerdict(ok=False, step=step, reason=error.reason, message=error.message)
    verdict = replay(transcript, step=step, through=through, transition=transition)
    if exact if exact is not None else exact_environment(transcript.root):
        verdict = require_exact(verdict)
    return verdict
