"""The JAX frontend's replay interface: a proof's attested step, rebuilt from its files.

:func:`load_transition` checks that the artifact (``program.jaxexport``,
:mod:`zkdv.jax.artifact`) hashes to the root record's program digest, decodes it with
:class:`~zkdv.jax.artifact.Artifact` (what answers the SDK's own sampled checks) and
returns a :class:`zkdv.replay.Transition` over host leaves in the transcript's schema
order. The platform's prover (``provers.jax_replay``, which adds the exactness policy)
and ``python -m zkdv calibrate`` use it.

A run that commits its gradients (artifact version 2, root ``schema.grad``) is
replayed in two halves. ``compute`` runs the committed *production* program, the very
program the training step ran, on the committed pre-state and the unpacked committed
batch, and returns its computed values (the gradient the optimizer received, then the
state the step wrote besides the optimizer); ``apply`` runs the committed apply program
on computed values: the optimizer's canonical update, the same bits on any hardware
(``Transition.canonical``; False for an optimizer without a canonical form, whose
post-update state the replay judges by the probes' tolerance), with its realized
deltas ``float32(after) - float32(before)``. An older run (version 1) has a
``transition`` program ``(params, opt_state, batch) -> (deltas, params_after,
opt_state_after)``, replayed whole.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from zkdv.batch import count_tokens
from zkdv.config import TOKEN_UNITS
from zkdv.jax._export import exact_environment_values
from zkdv.jax.artifact import Artifact
from zkdv.replay import Leaves, ReplayError, Transition, program_material, root_record
from zkdv.untrusted import ProgramUnsafeError, check_custom_calls

__all__ = [
    "PROGRAM_KINDS",
    "PROVER",
    "environment",
    "load_artifact",
    "load_transition",
    "transition",
]

PROVER = "whitebox-jax"
PROGRAM_KINDS = ("jax.export",)


def environment() -> dict[str, Any]:
    """This process's values of everything that changes a JAX program's bits, as the
    root record's ``env`` states them for the run: backend, ``jaxlib``, device kinds,
    ``threads`` (the CPUs the process may run on), ``cpu_isa`` (the instruction set XLA
    compiles for), ``cpu_model``, ``cpu_features``, ``xla_flags``, ``x64`` and
    ``matmul_precision``."""
    return exact_environment_values()


def _specs_match(artifact_specs: list[dict[str, Any]], schema: list[dict[str, Any]]) -> bool:
    def key(spec: dict[str, Any]) -> tuple[str, str, tuple[int, ...]]:
        return str(spec["path"]), str(np.dtype(spec["dtype"])), tuple(spec["shape"])

    return [key(s) for s in artifact_specs] == [key(s) for s in schema]


def load_artifact(proof_dir: str | os.PathLike[str]) -> tuple[Artifact, dict[str, Any]]:
    """The committed artifact of a ``whitebox-jax`` proof, checked, and its root record.

    Raises:
        zkdv.replay.ReplayError: ``program_mismatch`` when the artifact does not hash to
            the committed digest, is not a ZKDV JAX artifact, or was exported for another
            state schema (or other computed values); ``missing_file`` without it.
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
    check_programs(artifact)
    schema = root["schema"]
    if not (
        _specs_match(artifact.params, schema["params"])
        and _specs_match(artifact.opt_state, schema["opt_state"])
    ):
        raise ReplayError(
            "program_mismatch",
            "the program artifact was exported for another parameter or optimizer-state schema",
        )
    grad = schema.get("grad")
    if artifact.commits != (grad is not None) or (
        grad is not None and not _specs_match(artifact.computed, grad)
    ):
        raise ReplayError(
            "program_mismatch",
            "the program artifact computes other values than the root's schema.grad commits",
        )
    return artifact, root


def check_programs(artifact: Artifact) -> None:
    """Refuse an artifact whose programs call a custom-call target outside the allow-list.

    A custom call runs whatever the worker registered under its name (a host callback,
    an FFI handler): the lab may name only the targets of
    :data:`zkdv.untrusted.JAX_CUSTOM_CALLS`.

    Raises:
        zkdv.replay.ReplayError: ``program_unsafe`` naming the program and the target.
    """
    programs = {
        "production": artifact.production,
        "apply": artifact.apply_program,
        "attest": artifact.attest,
        "transition": artifact.transition,
    }
    for name, program in programs.items():
        if program is None:
            continue
        try:
            check_custom_calls(program.mlir_module(), where=f"the {name} program")
        except ProgramUnsafeError as error:
            raise ReplayError(error.reason, f"program.jaxexport: {error}") from None


def load_transition(proof_dir: str | os.PathLike[str]) -> Transition:
    """Load the committed programs of a ``whitebox-jax`` proof as a state transition.

    Args:
        proof_dir: the proof directory (``records.cborl`` and ``program.jaxexport``).

    Returns:
        The transition (module docstring); each program is compiled once, on first use.

    Raises:
        zkdv.replay.ReplayError: as :func:`load_artifact`; ``unsupported_program`` when a
            version-1 artifact has no transition.
    """
    artifact, root = load_artifact(proof_dir)
    return transition(artifact, root)


def transition(artifact: Artifact, root: dict[str, Any]) -> Transition:
    """The transition of an artifact already loaded and checked against ``root``.

    :func:`load_transition` loads it from the proof's files; the SDK's own
    ``proof.artifact`` shares the compiled programs the training step ran.

    Raises:
        zkdv.replay.ReplayError: ``unsupported_program`` when a version-1 artifact has
            no transition.
    """
    schema = root["schema"]
    param_paths = [str(s["path"]) for s in schema["params"]]
    opt_paths = [str(s["path"]) for s in schema["opt_state"]]
    tokens = _tokens(artifact, root)
    if artifact.commits:
        return dataclasses.replace(_committed(artifact, param_paths, opt_paths), tokens=tokens)
    if artifact.transition is None:
        raise ReplayError(
            "unsupported_program",
            "the artifact has no transition program (an explicit proof.attest run "
            "without zkdv.jax.index); only a snapshot step can be checked, by the SDK",
        )
    # One compilation per loaded artifact; later calls reuse the executable.
    program = jax.jit(artifact.transition.call)

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

    return Transition(transition, tokens=tokens)


def _tokens(artifact: Artifact, root: dict[str, Any]) -> int:
    """A step record's ``tokens`` as the SDK counts it: the program's per-example batch
    inputs (a PRNG key or scalar shared by every row aside) in the root's unit."""
    unit = str((root.get("config") or {}).get("token_unit", TOKEN_UNITS[0]))
    leaves = [(leaf.shape, leaf.dtype) for leaf in artifact.layout.leaves if not leaf.shared]
    try:
        return count_tokens(leaves, unit)
    except ValueError as error:
        raise ReplayError("invalid_transcript", f"the program's batch: {error}") from None


def _committed(artifact: Artifact, param_paths: list[str], opt_paths: list[str]) -> Transition:
    """The two halves of a version-2 artifact's step (module docstring)."""
    names = [str(s["path"]) for s in artifact.computed]

    def compute(
        params: Leaves, opt_state: Leaves, buffers: Leaves, batch: np.ndarray, step: Any
    ) -> Leaves:
        # Every input a JAX step reads is in the batch or the state: ``step`` is unused.
        values = artifact.compute(
            [a for _, a in params], [a for _, a in opt_state], np.asarray(batch, np.uint32)
        )
        return list(zip(names, (np.asarray(v) for v in values), strict=True))

    def apply(
        params: Leaves, opt_state: Leaves, buffers: Leaves, computed: Leaves, step: Any
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        params_after, opt_after, deltas = artifact.apply(
            [a for _, a in params], [a for _, a in opt_state], [a for _, a in computed]
        )
        return (
            list(zip(param_paths, (np.asarray(a) for a in params_after), strict=True)),
            list(zip(opt_paths, (np.asarray(a) for a in opt_after), strict=True)),
            list(buffers),  # JAX states carry no separate buffers tree
            list(zip(param_paths, (np.asarray(a) for a in deltas), strict=True)),
        )

    def whole(
        params: Leaves, opt_state: Leaves, buffers: Leaves, batch: np.ndarray, step: Any = None
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        computed = compute(params, opt_state, buffers, batch, step)
        return apply(params, opt_state, buffers, computed, step)

    return Transition(whole, compute=compute, apply=apply, canonical=artifact.canonical)
