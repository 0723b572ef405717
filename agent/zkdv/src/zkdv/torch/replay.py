"""The Torch frontend's replay interface: a proof's attested step, rebuilt from its files.

A Torch run commits two things that together make its transition
(``docs/torch.md``, "The attested step and lowering"):

* the sealed gradient program, ``(parameters..., buffers..., batch tensors...) ->
  (gradients..., buffers after...)``: an AOT Inductor package (``program.pt2``) or a
  ``torch.export`` program (``program.bin``), its digest in the root record;
* the optimizer, in the root record's ``env.optimizer``: the functional contract's name
  (the ``torch.optim`` class), every parameter group's options, the committed parameter
  names each group holds, and whether the run applied the canonical update
  (:mod:`zkdv.torch.optimizers.canonical`); and the batch packing in ``env.batch``.

:func:`load_transition` checks the artifact's digest, loads it with
:func:`zkdv.torch._artifact.load`, rebuilds the optimizer from the recorded options and
returns a :class:`zkdv.replay.Transition` whose halves are the SDK's own code: the
gradient program through :meth:`zkdv.torch._pipeline.Pipeline.gradients` (DDP rows
averaged as the all-reduce does) and the update through
:meth:`zkdv.torch.optimizers.bridge.OptimizerBridge.step`, exactly what answers the SDK's
sampled checks (STYLE rule 12). The platform's prover (``provers.torch_replay``) and
``python -m zkdv calibrate`` use it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from zkdv.batch import count_tokens
from zkdv.config import FLOPS_COUNTED, FLOPS_ESTIMATED, TOKEN_UNITS
from zkdv.gradients import leaf_name, split_name
from zkdv.replay import Leaves, ReplayError, Transition, program_material, root_record
from zkdv.torch import _artifact, _strides
from zkdv.torch._arrays import host_array
from zkdv.torch._artifact import AOT_INDUCTOR, TORCH_EXPORT
from zkdv.torch._checkpoint import ReplayCheckpoint
from zkdv.torch._packing import PACKING_VERSION, BatchLayout, LeafLayout
from zkdv.torch._pipeline import Pipeline
from zkdv.torch._rng import RNG_VERSION
from zkdv.torch.optimizers.bridge import SCALER, SCALER_ENTRIES, OptimizerBridge
from zkdv.torch.optimizers.canonical import CANONICAL_VERSION
from zkdv.torch.optimizers.registry import OptimizerRegistry
from zkdv.untrusted import ProgramUnsafeError

__all__ = ["AOT_INDUCTOR", "PROGRAM_KINDS", "PROVER", "TORCH_EXPORT", "load_transition"]

PROVER = "whitebox-torch"
#: The sealed program kinds a transcript may commit (``program.pt2``, ``program.bin``).
PROGRAM_KINDS = (AOT_INDUCTOR, TORCH_EXPORT)

State = dict[str, Any]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ReplayError("invalid_transcript", f"unknown tensor dtype {name!r} in the root record")
    return dtype


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor with ``array``'s bits (no copy when the array is writable)."""
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 has no Torch counterpart
        return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array)
    return torch.from_numpy(array)


def _batch_layout(env: dict[str, Any]) -> BatchLayout:
    """The packing of the program's tensor inputs, from the root record's ``env.batch``.

    Plain (non-tensor) batch values are fixed parts of the sealed program, so only the
    tensor leaves are rebuilt, as a flat list in pytree order.
    """
    batch = env.get("batch") or {}
    if batch.get("packing") != PACKING_VERSION:
        raise ReplayError(
            "unsupported_program", f"batch packing {batch.get('packing')!r} is not supported"
        )
    rows = int(batch["rows"])
    leaves = []
    for leaf in batch["leaves"]:
        if leaf is None:
            continue
        dtype = _torch_dtype(leaf["dtype"])
        shape = tuple(int(n) for n in leaf["shape"])
        numel = int(np.prod(shape, dtype=np.int64))
        row_bytes = numel // rows * torch.empty((), dtype=dtype).element_size()
        order = leaf.get("dim_order")
        leaves.append(
            LeafLayout(
                dtype,
                shape,
                int(leaf["offset"]),
                int(leaf["words"]),
                row_bytes,
                None if order is None else tuple(int(d) for d in order),
            )
        )
    spec = pytree.tree_flatten([0] * len(leaves))[1]
    return BatchLayout(spec, rows, int(batch["cols"]), tuple(leaves), (None,) * len(leaves), 0)


def _plain_option(value: Any) -> Any:
    # The root record stores tuples (betas) as lists.
    return tuple(_plain_option(v) for v in value) if isinstance(value, list) else value


def _optimizer(env: dict[str, Any], parameters: dict[str, torch.nn.Parameter]) -> OptimizerBridge:
    """Rebuild the run's optimizer (on placeholder parameters) as its bridge, with the
    update the run recorded: the canonical one, or the contract's own."""
    recorded = env.get("optimizer") or {}
    version = recorded.get("canonical")
    if version is not None and version != CANONICAL_VERSION:
        raise ReplayError(
            "unsupported_optimizer",
            f"the run's canonical optimizer update {version!r} is not {CANONICAL_VERSION!r}",
        )
    name = str(recorded.get("contract"))
    kind = getattr(torch.optim, name, None)
    registry = OptimizerRegistry()
    if not isinstance(kind, type) or kind not in registry:
        raise ReplayError(
            "unsupported_optimizer",
            f"the run's optimizer contract {name!r} is not a built-in torch.optim contract "
            "(a custom contract cannot be rebuilt from the transcript)",
        )
    members = recorded.get("group_parameters")
    groups = recorded.get("groups") or []
    if members is None:
        if len(groups) != 1:
            raise ReplayError(
                "unsupported_program",
                "the root record does not say which parameters each optimizer group holds "
                "(recorded since env.optimizer.group_parameters)",
            )
        members = [list(parameters)]
    try:
        optimizer = kind(
            [
                {"params": [parameters[n] for n in names]}
                | {k: _plain_option(v) for k, v in options.items()}
                for names, options in zip(members, groups, strict=True)
            ]
        )
        bridge = OptimizerBridge(
            optimizer, registry.resolve(optimizer), canonical=version is not None
        )
        bridge.bind(tuple(parameters.values()))
    except (KeyError, TypeError, ValueError) as error:
        raise ReplayError(
            "program_mismatch", f"the recorded optimizer {name} cannot be rebuilt: {error}"
        ) from None
    return bridge


def _run_seed(env: dict[str, Any]) -> int | None:
    """The committed seed of the program's random operators (``env.rng``), if any."""
    recorded = env.get("rng")
    if recorded is None:
        return None
    if (
        not isinstance(recorded, dict)
        or recorded.get("derivation") != RNG_VERSION
        or not isinstance(recorded.get("seed"), int)
    ):
        raise ReplayError(
            "unsupported_program",
            f"the root record's random-number seed {recorded!r} is not a "
            f"{RNG_VERSION} seed this prover can replay",
        )
    return int(recorded["seed"])


def _states(bridge: OptimizerBridge, leaves: list[torch.Tensor]) -> list[State]:
    """Per-parameter optimizer states from the committed leaves (the bridge's order)."""
    supply = iter(leaves)
    states = []
    templates = bridge.live_states()[: len(bridge.state_names)]
    for template, entries in zip(templates, bridge.state_names, strict=True):
        state: State = {}
        for entry in entries:
            leaf = next(supply)
            like = template.get(entry)
            if isinstance(like, torch.Tensor):
                state[entry] = leaf
            elif like is None:
                # An absent buffer (SGD momentum before its first step) is committed as
                # zeros; an all-zero committed buffer is taken as absent.
                state[entry] = None if not bool(leaf.any()) else leaf
            elif isinstance(like, bool | int):
                state[entry] = int(leaf.item())
            else:
                state[entry] = float(leaf.item())
        states.append(state)
    if bridge.scaled:  # a GradScaler's state follows, its leaves in sorted entry order
        states.append({entry: next(supply) for entry in SCALER_ENTRIES})
    return states


def _tokens(root: dict[str, Any], env: dict[str, Any]) -> int:
    """A step record's ``tokens`` as the SDK counts it: the program's batch tensors (the
    root's ``env.batch``) in the root's unit, on each of ``env.world_size`` ranks."""
    unit = str((root.get("config") or {}).get("token_unit", TOKEN_UNITS[0]))
    leaves = [leaf for leaf in (env.get("batch") or {}).get("leaves", []) if leaf is not None]
    try:
        per_rank = count_tokens([(leaf["shape"], leaf["dtype"]) for leaf in leaves], unit)
    except (KeyError, TypeError, ValueError) as error:
        raise ReplayError(
            "invalid_transcript", f"the root's env.batch cannot be counted in {unit!r}: {error}"
        ) from None
    return per_rank * int(env.get("world_size", 1))


def _flops(root: dict[str, Any], env: dict[str, Any], program: Any, tokens: int) -> float | None:
    """A step record's ``flops`` as the SDK counts it, recounted: Torch's FLOP counter on
    the committed program, times the ranks (``env.world_size``), or the SDK's estimate
    ``6 x parameters x tokens`` where it recorded that it estimated. None where neither
    can be recomputed (an AOT Inductor program, an unstated method)."""
    stated = env.get("flops")
    method = stated.get("method") if isinstance(stated, dict) else None
    if method == FLOPS_ESTIMATED:
        parameters = sum(
            int(np.prod(spec["shape"], dtype=np.int64)) for spec in root["schema"]["params"]
        )
        return 6.0 * parameters * tokens
    if method != FLOPS_COUNTED:
        return None
    counted = program.count_flops()
    return None if counted is None else counted * int(env.get("world_size", 1))


def load_transition(proof_dir: str | os.PathLike[str]) -> Transition:
    """Load the committed program and optimizer of a ``whitebox-torch`` proof.

    Args:
        proof_dir: the proof directory (``records.cborl`` and the program artifact).

    Returns:
        ``(params, opt_state, buffers, batch) -> (params, opt_state, buffers, deltas)``,
        split into ``compute`` and ``apply`` for a run that commits its gradients.

    Raises:
        provers.replay.ReplayError: ``program_mismatch`` when the artifact does not hash
            to the committed digest or cannot be loaded; ``program_unsafe`` when it is
            an AOT Inductor package (native code) or a ``torch.export`` archive that
            :func:`zkdv.untrusted.safe_export_archive` refuses; ``unsupported_optimizer`` or
            ``unsupported_program`` when the root record does not describe a
            transition this prover can rebuild.
    """
    root = root_record(proof_dir)
    if root.get("prover") != PROVER:
        raise ReplayError(
            "program_mismatch", f"the proof names prover {root.get('prover')!r}, not {PROVER!r}"
        )
    kind, material = program_material(proof_dir, root, PROGRAM_KINDS)
    try:
        program = _artifact.load(material, kind)
    except ProgramUnsafeError as error:
        raise ReplayError(error.reason, f"the {kind} program artifact: {error}") from None
    except Exception as error:  # noqa: BLE001 - any loader failure means a bad artifact
        raise ReplayError(
            "program_mismatch", f"the {kind} program artifact cannot be loaded: {error}"
        ) from None
    env = root.get("env") or {}
    step = _Step(program, env, root["schema"])
    committed = bool(step.computed_names)
    tokens = _tokens(root, env)
    return Transition(
        step.whole,
        step.compute if committed else None,
        step.apply if committed else None,
        canonical=step.bridge.canonical,
        tokens=tokens,
        flops=_flops(root, env, program, tokens),
    )


def _bridge(
    env: dict[str, Any], schema: dict[str, Any], placeholders: dict[str, torch.nn.Parameter]
) -> OptimizerBridge:
    """The recorded optimizer (and loss scaler), checked against the committed schema."""
    bridge = _optimizer(env, placeholders)
    scaler_options = env.get("grad_scaler")
    if scaler_options is not None:
        if not isinstance(scaler_options, dict):
            raise ReplayError("unsupported_program", "the root's env.grad_scaler is malformed")
        bridge.bind_scaler(None, scaler_options)
    state_paths = [str(spec["path"]) for spec in schema["opt_state"]]
    if bridge.leaf_paths(list(placeholders)) != state_paths:
        raise ReplayError(
            "program_mismatch",
            "the recorded optimizer's state layout is not the committed optimizer-state schema",
        )
    return bridge


class _Step:
    """One committed step of a Torch run, rebuilt: the gradient program (through the
    training pipeline, on the CPU) and the recorded optimizer, on host leaves."""

    def __init__(self, program: Any, env: dict[str, Any], schema: dict[str, Any]) -> None:
        self.names = [str(spec["path"]) for spec in schema["params"]]
        placeholders = {
            str(spec["path"]): torch.nn.Parameter(
                torch.zeros(tuple(spec["shape"]), dtype=_torch_dtype(spec["dtype"]))
            )
            for spec in schema["params"]
        }
        self.bridge = _bridge(env, schema, placeholders)
        self.state_paths = [str(spec["path"]) for spec in schema["opt_state"]]
        self.buffer_names = [str(spec["path"]) for spec in schema["buffers"]]
        self.computed_names = [str(spec["path"]) for spec in schema.get("grad") or []]
        self.trained = {
            path
            for tree, path in (split_name(name) for name in self.computed_names)
            if tree == "params"
        }
        self.orders = env.get("dim_orders") or {}
        unused = set((env.get("program") or {}).get("unused_gradients") or [])
        run_seed = _run_seed(env)
        self.pipeline = Pipeline(
            program,
            [name in unused for name in self.names],
            self.bridge,
            _batch_layout(env),
            ReplayCheckpoint(interval=1, capacity=1),
            parameter_sizes=[p.numel() for p in placeholders.values()],
            state_sizes=[
                int(np.prod(spec["shape"], dtype=np.int64)) for spec in schema["opt_state"]
            ],
            buffer_count=len(schema["buffers"]),
            device=torch.device("cpu"),
            world_size=int(env.get("world_size", 1)),
            run_seed=run_seed,
        )
        if program.random and run_seed is None:
            raise ReplayError(
                "program_mismatch",
                "the program draws random numbers but the root record commits no seed (env.rng)",
            )

    def laid_out(self, tree: str, leaves: Leaves) -> list[torch.Tensor]:
        """The leaves as tensors, each in the memory format training kept it in."""
        recorded = self.orders.get(tree) or {}
        return [_strides.in_order(_tensor(array), recorded.get(name)) for name, array in leaves]

    def prepared(
        self, params: Leaves, opt_state: Leaves, buffers: Leaves
    ) -> tuple[list[torch.Tensor], list[State], list[torch.Tensor]]:
        return (
            self.laid_out("params", params),
            _states(self.bridge, self.laid_out("opt_state", opt_state)),
            self.laid_out("buffers", buffers),
        )

    def gradients(
        self,
        before: list[torch.Tensor],
        states: list[State],
        buffers: list[torch.Tensor],
        batch: np.ndarray,
        step: dict[str, Any],
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor], Any]:
        """The gradient program on the pre-state: gradients, buffers after, the scaler."""
        gradients, buffers_after, scaler = self.pipeline.gradients(
            before,
            buffers,
            np.asarray(batch),
            int(step["i"]),
            states[-1] if self.bridge.scaled else None,
        )
        return gradients, buffers_after, scaler

    def update(
        self,
        before: list[torch.Tensor],
        states: list[State],
        gradients: list[torch.Tensor | None],
        step: dict[str, Any],
        scaler: Any,
    ) -> tuple[list[torch.Tensor], list[State]]:
        try:
            return self.bridge.step(before, states, gradients, step.get("hp"), scaler=scaler)
        except (TypeError, ValueError) as error:
            raise ReplayError(
                "invalid_transcript", f"step {step['i']}'s optimizer options (hp): {error}"
            ) from None

    def finished(
        self,
        before: list[torch.Tensor],
        after: list[torch.Tensor],
        states_after: list[State],
        buffers_after: list[torch.Tensor],
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        """The post-state as named host leaves, and the deltas ``post - pre`` in float32
        (what the committed delta probe projects)."""
        deltas = [a.float() - b.float() for a, b in zip(after, before, strict=True)]
        return (
            [(n, host_array(t)) for n, t in zip(self.names, after, strict=True)],
            [
                (n, host_array(t))
                for n, t in zip(
                    self.state_paths, self.bridge.leaves(states_after, after), strict=True
                )
            ],
            [(n, host_array(t)) for n, t in zip(self.buffer_names, buffers_after, strict=True)],
            [(n, host_array(t)) for n, t in zip(self.names, deltas, strict=True)],
        )

    def whole(
        self,
        params: Leaves,
        opt_state: Leaves,
        buffers: Leaves,
        batch: np.ndarray,
        step: dict[str, Any],
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        """The whole step: the gradient program, then the optimizer on its gradients."""
        before, states, buffers_before = self.prepared(params, opt_state, buffers)
        with torch.no_grad():
            gradients, buffers_after, scaler = self.gradients(
                before, states, buffers_before, batch, step
            )
            after, states_after = self.update(before, states, gradients, step, scaler)
            return self.finished(before, after, states_after, buffers_after)

    def compute(
        self, params: Leaves, opt_state: Leaves, buffers: Leaves, batch: np.ndarray, step: Any
    ) -> Leaves:
        """The step's computed values: the gradient program on the committed pre-state."""
        before, states, buffers_before = self.prepared(params, opt_state, buffers)
        with torch.no_grad():
            gradients, buffers_after, scaler = self.gradients(
                before, states, buffers_before, batch, step
            )
        out: list[tuple[str, np.ndarray]] = []
        for name, gradient, placeholder in zip(self.names, gradients, before, strict=True):
            if name in self.trained:
                # A parameter the program gives no gradient this step reads as zeros.
                value = torch.zeros_like(placeholder) if gradient is None else gradient
                out.append((leaf_name("params", name), host_array(value)))
        out += [
            (leaf_name("buffers", name), host_array(buffer))
            for name, buffer in zip(self.buffer_names, buffers_after, strict=True)
        ]
        if scaler is not None:
            _, growth_tracker, scale = scaler
            out += [
                (leaf_name("opt_state", f"{SCALER}.growth_tracker"), host_array(growth_tracker)),
                (leaf_name("opt_state", f"{SCALER}.scale"), host_array(scale)),
            ]
        return out

    def apply(
        self, params: Leaves, opt_state: Leaves, buffers: Leaves, committed: Leaves, step: Any
    ) -> tuple[Leaves, Leaves, Leaves, Leaves]:
        """The optimizer applied to the committed gradient; the committed buffers kept."""
        before, states, _ = self.prepared(params, opt_state, buffers)
        values = dict(committed)
        gradients: list[torch.Tensor | None] = [
            _tensor(values[leaf_name("params", name)]) if name in self.trained else None
            for name in self.names
        ]
        scaler = None
        if self.bridge.scaled:
            present = [gradient for gradient in gradients if gradient is not None]
            overflow = not all(bool(torch.isfinite(g).all()) for g in present)
            scaler = (
                torch.tensor(1.0 if overflow else 0.0),
                _tensor(values[leaf_name("opt_state", f"{SCALER}.growth_tracker")]),
                _tensor(values[leaf_name("opt_state", f"{SCALER}.scale")]),
            )
        buffers_after = self.laid_out(
            "buffers", [(name, values[leaf_name("buffers", name)]) for name in self.buffer_names]
        )
        with torch.no_grad():
            after, states_after = self.update(before, states, gradients, step, scaler)
            return self.finished(before, after, states_after, buffers_after)
