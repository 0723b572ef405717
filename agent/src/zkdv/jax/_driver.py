"""The JAX driver: ``zkdv.jax.ZKDV`` with ``jit`` (the training step) and ``attest``.

One ``proof.jit`` invocation is one transcript transaction. The wrapper flattens the
call's dynamic arguments into leaves, runs one compiled program that returns the user's
result *and* the transaction's hidden values (additive deltas, post-update parameters
and optimizer state, the packed uint32 batch; :class:`~zkdv.compilation.ResultSchema`
lays them out so a value the user also returns crosses the program boundary once), and
hands a :class:`_Step` to the shared :class:`~zkdv.driver.Driver` pipeline, which
commits it on its own thread. The design, the batch packing and the artifact format
are documented in ``docs/jax.md``.

Under ``jax.distributed`` (several processes, one SPMD program) process 0 owns the
transcript; the others (followers) run the same program and learn over
:class:`~zkdv.control.HostControl`, before each step, whether rank 0 may go on, so every
process stops at the same step. The packed batch is all-gathered inside the step, so
rank 0 commits the global batch without a separate collective, and the committed state
must be replicated across processes (data parallelism; sharding within a process is
free).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from zkdv.batch import validate_window
from zkdv.compilation import ResultSchema, jax_trees
from zkdv.config import ZKDVConfig
from zkdv.driver import Driver, Leaves, ReplayOutcome, Submission
from zkdv.errors import (
    CLOSED,
    NOT_STARTED,
    ZKDVError,
    ZKDVPoisonedError,
    ZKDVVerificationError,
)
from zkdv.jax import _context, _messages
from zkdv.jax._device import DeviceCommitter, SnapshotPool, TransferLog, host_shardings, leaf_specs
from zkdv.jax._tree import BatchLayout, index, leaf_paths
from zkdv.jax.artifact import Artifact, dumps
from zkdv.jax.device_merkle import default_schedule
from zkdv.merkle import StateCommitment
from zkdv.overlap import Policy
from zkdv.pipeline import State
from zkdv.probes import ProbeSet
from zkdv.sampling import Challenge
from zkdv.signature import FunctionSignature
from zkdv.transaction import bind_input

__all__ = ["JIT_OPTIONS", "ZKDV", "JitFunction"]

JIT_OPTIONS = frozenset(
    {
        "in_shardings",
        "out_shardings",
        "static_argnums",
        "static_argnames",
        "donate_argnums",
        "donate_argnames",
        "keep_unused",
        "device",
        "backend",
        "inline",
        "compiler_options",
    }
)
# Options forwarded to jax.jit unchanged (the others are resolved by the wrapper).
_PASSTHROUGH = ("keep_unused", "device", "backend", "inline", "compiler_options")
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
# The artifact's ``source``: what declared the transaction whose program is generated.
_SOURCES = {"train_state": "zkdv.jax.contrib.TrainState", "nnx": "flax.nnx.Optimizer"}


def _annotation(name: str) -> contextlib.AbstractContextManager[Any]:
    return jax.profiler.TraceAnnotation(name)


def _check_options(options: dict[str, Any], api: str) -> None:
    unknown = sorted(set(options) - JIT_OPTIONS)
    if unknown:
        raise TypeError(f"{api} got unexpected jax.jit options {unknown}")


def _host_copy(leaves: Sequence[Any]) -> list[np.ndarray]:
    # np.array copies: the source buffers are about to be donated. Python scalars (a
    # fresh TrainState's step) take JAX's dtype, as the compiled program sees them.
    return [
        np.array(leaf)
        if isinstance(leaf, jax.Array | np.ndarray)
        else np.asarray(jnp.asarray(leaf))
        for leaf in leaves
    ]


@functools.lru_cache(maxsize=256)
def _host_sharding(sharding: Sharding) -> Sharding | None:
    device: Any = next(iter(sharding.device_set))
    kinds = {memory.kind for memory in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return sharding.with_memory_kind(kind)
    return None


def _to_host(leaf: Any) -> Any:
    """Launch an asynchronous copy of ``leaf`` into host memory (pinned when offered).

    JAX orders the copy before any later program that donates ``leaf``, so the
    training thread never waits for it.
    """
    if not isinstance(leaf, jax.Array):
        return np.array(leaf)
    target = _host_sharding(leaf.sharding)
    if target is None:
        return jax.device_put(leaf, leaf.sharding, may_alias=False)
    return jax.device_put(leaf, target, may_alias=False)


def _nbytes(leaf: Any) -> int:
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(jnp.result_type(leaf)).itemsize


def _replicated_sharding(leaves: Sequence[Any]) -> NamedSharding:
    """A fully replicated sharding on the mesh of the step's inputs (multi-process)."""
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())  # type: ignore[no-untyped-call]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("zkdv",))
    return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def _layout(leaf: Any, default: Sharding) -> Sharding:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, Sharding) else default


def _pin(tree: Any, layouts: Sequence[Sharding], default: Sharding) -> Any:
    """Constrain a traced PyTree's leaves to ``layouts`` (one per leaf, else ``default``)."""
    flat, structure = jax.tree.flatten(tree)
    if len(layouts) != len(flat):
        layouts = [default] * len(flat)
    return jax.tree.unflatten(
        structure,
        [_constrain(x, s) for x, s in zip(flat, layouts, strict=True)],
    )


def _constrain(value: Any, sharding: Sharding) -> Any:
    # Explicit mesh axes make a layout part of the type: only reshard changes it there.
    if isinstance(sharding, NamedSharding) and any(
        kind == jax.sharding.AxisType.Explicit for kind in sharding.mesh.axis_types
    ):
        return jax.sharding.reshard(value, sharding)  # type: ignore[no-untyped-call]
    return jax.lax.with_sharding_constraint(value, sharding)  # type: ignore[no-untyped-call]


def _unreplicated(leaves: Sequence[Any], paths: Sequence[str]) -> list[str]:
    """Paths of committed leaves that process 0 cannot read whole (multi-process)."""
    return [
        path
        for path, leaf in zip(paths, leaves, strict=True)
        if isinstance(leaf, jax.Array)
        and not (leaf.is_fully_addressable or leaf.is_fully_replicated)
    ]


def _describe_sharding(leaf: Any) -> dict[str, Any] | None:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = [
            None if axis is None else (list(axis) if isinstance(axis, tuple) else str(axis))
            for axis in sharding.spec
        ]
        return {"mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()}, "spec": spec}
    if sharding is not None and len(sharding.device_set) > 1:
        return {"devices": len(sharding.device_set)}
    return None


def _select(views: Sequence[np.ndarray], flat_index: int) -> float:
    offset = 0
    for view in views:
        if flat_index < offset + view.size:
            return float(view.reshape(-1)[flat_index - offset])
        offset += view.size
    return 0.0


def _is_sharding_leaf(value: Any) -> bool:
    return value is None or isinstance(value, Sharding | PartitionSpec)


@dataclass
class _Traced:
    """What the production trace learned; filled while JAX traces the step."""

    registration: _context.Registration
    schema: ResultSchema
    layout: BatchLayout
    param_positions: tuple[int, ...]
    opt_positions: tuple[int, ...]
    batch_positions: tuple[int, ...]
    param_paths: list[str]
    opt_paths: list[str]
    param_tree: Any
    opt_tree: Any
    batch_tree: Any
    delta_leaves: int


class _Program:
    """The one compiled production program of a proof, and what its steps need."""

    def __init__(
        self,
        function: JitFunction,
        jitted: Any,
        traced: _Traced,
        donated: tuple[int, ...],
        kept: tuple[int, ...],
        avals: list[tuple[tuple[int, ...], Any]],
        flops: float | None,
        static_key: Any,
    ) -> None:
        self.function = function
        self.jitted = jitted
        self.traced = traced
        self.donated = donated
        self.kept = kept
        self.avals = avals
        self.flops = flops
        self.static_key = static_key
        self.trees = jax_trees()
        self.function_tree: Any = None


class JitFunction:
    """A ``proof.jit``-compiled training step: one transcript transaction per call."""

    def __init__(self, proof: ZKDV, function: Callable[..., Any], options: dict[str, Any]):
        _check_options(options, "ZKDV.jit")
        functools.update_wrapper(self, function)
        self._proof = proof
        self._function = function
        self._options = dict(options)
        self._signature = FunctionSignature(function, "ZKDV.jit")
        static, _ = self._signature.static(
            options.get("static_argnums"), options.get("static_argnames")
        )
        self._static = frozenset(static)
        self._donate = frozenset(
            self._signature.argnums(options.get("donate_argnums"))
        ) | frozenset(self._signature.argnums_of(options.get("donate_argnames")))
        if self._donate & self._static:
            raise ValueError("ZKDV.jit cannot donate a static argument")
        self._policies: dict[int, Policy] = {}
        self._program: _Program | None = None
        self._lock = threading.Lock()
        self._graphs: Any = None  # the zkdv.jax._nnx.GraphFunction of a Flax NNX step

    # -- call ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from zkdv.jax import _nnx
        from zkdv.jax.contrib import TrainState

        if self._graphs is not None or _nnx.has_graph_nodes(args, kwargs):
            # Flax NNX objects: split, run as a pure function, updated in place.
            with self._lock:
                if self._graphs is None:
                    self._graphs = _nnx.GraphFunction(self)
            return self._graphs(*args, **kwargs)
        proof = self._proof
        proof._require_step()
        values = list(self._signature.bind(*args, **kwargs))
        policy: Policy | None = None
        restore: Policy | None = None
        for position, value in enumerate(values):
            if isinstance(value, Policy):
                # Host-side metadata: excluded from the trace, read per invocation.
                policy = value
                values[position] = self._policies.setdefault(position, value)
            elif isinstance(value, TrainState):
                if value.proof is not proof:
                    owner = "no proof" if value.proof is None else "a different proof object"
                    raise ZKDVError(_messages.PROOF_IDENTITY.format(owner=owner))
                policy = Policy(value.zkdv_overlap)
                if policy is not Policy.UNCHECKED:
                    # The policy is a static field: normalise it so changing it neither
                    # retraces nor changes the committed program.
                    restore = policy
                    values[position] = value.replace(zkdv_overlap=Policy.UNCHECKED)
        fixed = self._static | frozenset(self._policies)
        static_key = tuple(values[i] for i in sorted(self._static))
        dynamic = tuple(value for i, value in enumerate(values) if i not in fixed)
        leaves, in_tree = jax.tree.flatten(dynamic)
        program = self._program
        if program is None:
            with self._lock:
                program = self._program
                if program is None:
                    program = self._build(values, fixed, leaves, in_tree, static_key)
                    self._program = program
        self._compatible(program, leaves, in_tree, static_key)
        result = proof._step(program, leaves, policy)
        if restore is not None:
            result = jax.tree.map(
                lambda node: (
                    node.replace(zkdv_overlap=restore) if isinstance(node, TrainState) else node
                ),
                result,
                is_leaf=lambda node: isinstance(node, TrainState),
            )
        return result

    def _compatible(
        self, program: _Program, leaves: list[Any], in_tree: Any, static_key: Any
    ) -> None:
        if static_key != program.static_key:
            names = [self._signature.names[i] for i in sorted(self._static)]
            if program.traced.registration.source != "transaction":
                raise ZKDVError(
                    _messages.STATIC_ARGUMENT.format(
                        names=names, old=program.static_key, new=static_key
                    )
                )
            raise ZKDVError(
                _messages.INCOMPATIBLE.format(detail=f"static arguments {names} changed")
            )
        if in_tree != program.function_tree:
            raise ZKDVError(_messages.INCOMPATIBLE.format(detail="the argument PyTrees changed"))
        for position, (leaf, (shape, dtype)) in enumerate(zip(leaves, program.avals, strict=True)):
            if getattr(leaf, "shape", None) == shape and getattr(leaf, "dtype", None) == dtype:
                continue
            got = (tuple(jnp.shape(leaf)), jnp.result_type(leaf))
            if got != (shape, dtype):
                raise ZKDVError(
                    _messages.INCOMPATIBLE.format(
                        detail=f"input leaf {position} is {got}, the first call fixed "
                        f"{(shape, dtype)}"
                    )
                )

    # -- build --------------------------------------------------------------------------
    def _build(
        self,
        values: list[Any],
        fixed: frozenset[int],
        leaves: list[Any],
        in_tree: Any,
        static_key: Any,
    ) -> _Program:
        proof = self._proof
        if proof._program_owner is not None:
            raise ZKDVError(
                _messages.INCOMPATIBLE.format(
                    detail="this proof already compiled another proof.jit function; one "
                    "proof records one training step function"
                )
            )
        trees = jax_trees()
        count = len(leaves)
        # Leaf ranges of every dynamic argument, and the donated leaves.
        dynamic_positions = [i for i in range(len(values)) if i not in fixed]
        donated: list[int] = []
        start = 0
        ranges: dict[int, tuple[int, int]] = {}
        for position in dynamic_positions:
            value = values[position]
            size = len(jax.tree.leaves(value))
            ranges[position] = (start, start + size)
            if position in self._donate:
                donatable = getattr(value, "_zkdv_donatable", None)
                if donatable is not None:
                    # A donated TrainState (or Flax NNX object) lowers to parameter-only
                    # donation.
                    ids = {id(leaf) for leaf in donatable()}
                    donated.extend(i for i in range(start, start + size) if id(leaves[i]) in ids)
                else:
                    donated.extend(range(start, start + size))
            start += size
        donated_set = frozenset(donated)
        kept = tuple(i for i in range(count) if i not in donated_set)
        donated_t = tuple(donated)
        shardings = self._leaf_shardings(values, dynamic_positions, leaves)
        gathered = _replicated_sharding(leaves) if jax.process_count() > 1 else None
        holder: dict[str, _Traced] = {}
        signature = self._signature

        def rebuild(leaf_values: list[Any]) -> list[Any]:
            dynamic = jax.tree.unflatten(in_tree, leaf_values)
            full = list(values)
            for position, value in zip(dynamic_positions, dynamic, strict=True):
                full[position] = value
            return full

        def production(donated_leaves: tuple[Any, ...], kept_leaves: tuple[Any, ...]) -> Any:
            leaf_values: list[Any] = [None] * count
            for i, position in enumerate(donated_t):
                leaf_values[position] = donated_leaves[i]
            for i, position in enumerate(kept):
                leaf_values[position] = kept_leaves[i]
            context = _context.TraceContext(proof, "production", leaf_values)
            with _context.active(context):
                result = signature.call(rebuild(leaf_values))
            traced = self._registered(context, leaf_values, donated_set, in_tree, values)
            hidden = (
                traced.registration.deltas,
                traced.registration.params_after,
                traced.registration.opt_after,
            )
            scan = traced.registration.scan
            if scan is not None:
                # Several updates (zkdv.jax.scan): their batches were packed in the loop.
                packed = scan.packed
            else:
                batch_leaves = (
                    [leaf_values[i] for i in traced.batch_positions]
                    if traced.registration.source != "transaction"
                    else jax.tree.leaves(traced.registration.batch)
                )
                packed = traced.layout.pack(batch_leaves)
            if gathered is not None:
                # Rank 0 commits the global batch: all-gather it inside the step. The
                # committed state keeps its input layouts, which _install checked are
                # whole on every process, so rank 0 reads it without a collective.
                packed = _constrain(packed, gathered)
                param_layouts = [_layout(leaves[i], gathered) for i in traced.param_positions]
                opt_layouts = [_layout(leaves[i], gathered) for i in traced.opt_positions]
                hidden = (
                    _pin(hidden[0], param_layouts, gathered),
                    _pin(hidden[1], param_layouts, gathered),
                    _pin(hidden[2], opt_layouts, gathered),
                )
            extra = [packed] if scan is None else [packed, *scan.stacked]
            schema, flat = ResultSchema.build(
                result, hidden, trees, delta_leaves=traced.delta_leaves, extra=extra
            )
            traced.schema = schema
            holder["traced"] = traced
            return tuple(flat)

        options: dict[str, Any] = {
            name: self._options[name] for name in _PASSTHROUGH if name in self._options
        }
        if shardings is not None:
            options["in_shardings"] = (
                tuple(shardings[i] for i in donated_t),
                tuple(shardings[i] for i in kept),
            )
        donated_args = tuple(leaves[i] for i in donated_t)
        kept_args = tuple(leaves[i] for i in kept)
        jitted = jax.jit(production, donate_argnums=(0,) if donated_t else (), **options)
        lowered_from = jitted.trace(donated_args, kept_args)
        out_shardings = self._options.get("out_shardings")
        if out_shardings is not None:
            # The flat output layout is known only after tracing; map the user's
            # result shardings onto it and trace once more with them.
            schema = holder["traced"].schema
            user_leaves = jax.tree.broadcast(
                out_shardings,
                trees.unflatten(schema.tree, [0] * len(schema.sources)),
                is_leaf=_is_sharding_leaf,
            )
            per_output: list[Any] = [None] * schema.outputs
            for source, sharding in zip(
                schema.sources,
                jax.tree.leaves(user_leaves, is_leaf=_is_sharding_leaf),
                strict=True,
            ):
                per_output[source] = sharding
            jitted = jax.jit(
                production,
                donate_argnums=(0,) if donated_t else (),
                out_shardings=tuple(per_output),
                **options,
            )
            lowered_from = jitted.trace(donated_args, kept_args)
        compiled = lowered_from.lower().compile()
        traced = holder["traced"]
        program = _Program(
            self,
            jitted,
            traced,
            donated_t,
            kept,
            [(tuple(jnp.shape(leaf)), jnp.result_type(leaf)) for leaf in leaves],
            _flops(compiled),
            static_key,
        )
        program.function_tree = in_tree
        proof._install(program, leaves, self._replay_builder(values, dynamic_positions, in_tree))
        return program

    def _leaf_shardings(
        self, values: list[Any], dynamic_positions: list[int], leaves: list[Any]
    ) -> list[Any] | None:
        in_shardings = self._options.get("in_shardings")
        if in_shardings is None:
            return None
        if _is_sharding_leaf(in_shardings) and in_shardings is not None:
            return [in_shardings] * len(leaves)
        entries = list(in_shardings)
        if len(entries) == len(values):
            entries = [entries[i] for i in dynamic_positions]
        if len(entries) > len(dynamic_positions):
            raise ValueError(
                f"ZKDV.jit in_shardings has {len(entries)} entries for "
                f"{len(dynamic_positions)} dynamic arguments"
            )
        # Like jax.jit, entries name the leading dynamic parameters; arguments after
        # them (typically passed by keyword) are left to the compiler.
        entries += [None] * (len(dynamic_positions) - len(entries))
        out: list[Any] = []
        for entry, position in zip(entries, dynamic_positions, strict=True):
            value = values[position]
            if _is_sharding_leaf(entry):
                out.extend([entry] * len(jax.tree.leaves(value)))
            else:
                broadcast = jax.tree.broadcast(entry, value, is_leaf=_is_sharding_leaf)
                out.extend(jax.tree.leaves(broadcast, is_leaf=_is_sharding_leaf))
        return out

    def _registered(
        self,
        context: _context.TraceContext,
        leaf_values: list[Any],
        donated: frozenset[int],
        in_tree: Any,
        values: list[Any],
    ) -> _Traced:
        registration = context.registration
        if registration is None:
            raise ZKDVError(_messages.NO_TRANSACTION)
        if not registration.completed:
            raise ZKDVError(_context.UPDATE_MISSING)
        trees = jax_trees()
        try:
            params = bind_input(leaf_values, registration.params_before, "params", trees)
        except ValueError:
            raise ZKDVError(_messages.NOT_AN_INPUT.format(name="params")) from None
        try:
            opt = bind_input(leaf_values, registration.opt_before, "opt_state", trees)
        except ValueError:
            raise ZKDVError(_messages.NOT_AN_INPUT.format(name="opt_state")) from None
        if donated & set(opt.leaves):
            raise ZKDVError(_messages.DONATED_OPT_STATE)
        param_tree = jax.tree.structure(registration.params_before)
        opt_tree = jax.tree.structure(registration.opt_before)
        for name, value, like, want in (
            ("deltas", registration.deltas, "params", param_tree),
            ("params", registration.params_after, "params", param_tree),
            ("opt_state", registration.opt_after, "opt_state", opt_tree),
        ):
            got: Any = jax.tree.structure(value)
            if got != want:
                raise ZKDVError(
                    _messages.STRUCTURE.format(name=name, like=like, got=got, want=want)
                )
        state_positions = set(params.leaves) | set(opt.leaves)
        batch_positions: tuple[int, ...] = ()
        batch_tree = None
        if registration.scan is not None:
            # zkdv.jax.scan packed each update's batch inside the loop.
            layout = registration.scan.layout
        elif registration.source != "transaction":
            batch_positions = tuple(i for i in range(len(leaf_values)) if i not in state_positions)
            paths = leaf_paths(jax.tree.unflatten(in_tree, list(range(len(leaf_values)))), "args")
            layout = BatchLayout.of(
                [paths[i] for i in batch_positions], [leaf_values[i] for i in batch_positions]
            )
        else:
            batch_tree = jax.tree.structure(registration.batch)
            layout = BatchLayout.of(
                leaf_paths(registration.batch, "batch"), jax.tree.leaves(registration.batch)
            )
        return _Traced(
            registration=registration,
            schema=None,  # type: ignore[arg-type]  # set right after
            layout=layout,
            param_positions=params.leaves,
            opt_positions=opt.leaves,
            batch_positions=batch_positions,
            param_paths=leaf_paths(registration.params_before, "params"),
            opt_paths=leaf_paths(registration.opt_before, "opt_state"),
            param_tree=param_tree,
            opt_tree=opt_tree,
            batch_tree=batch_tree,
            delta_leaves=len(jax.tree.leaves(registration.deltas)),
        )

    def _replay_builder(
        self, values: list[Any], dynamic_positions: list[int], in_tree: Any
    ) -> Callable[[_Traced], Callable[..., Any]]:
        """The staged training function replayed up to its update boundary (contrib)."""
        from zkdv.jax.contrib import TrainState

        proof = self._proof
        signature = self._signature

        def build(traced: _Traced) -> Callable[..., Any]:
            count = len(traced.param_positions) + len(traced.opt_positions)
            count += len(traced.batch_positions)

            def transition(
                params: tuple[Any, ...], opt_state: tuple[Any, ...], batch: Any
            ) -> tuple[Any, Any, Any]:
                leaf_values: list[Any] = [None] * count
                for position, value in zip(traced.param_positions, params, strict=True):
                    leaf_values[position] = value
                for position, value in zip(traced.opt_positions, opt_state, strict=True):
                    leaf_values[position] = value
                unpacked = traced.layout.unpack(batch)
                for position, value in zip(traced.batch_positions, unpacked, strict=True):
                    leaf_values[position] = value
                dynamic = jax.tree.unflatten(in_tree, leaf_values)
                full = list(values)
                for position, value in zip(dynamic_positions, dynamic, strict=True):
                    if isinstance(value, TrainState) and value.attest_apply_fn is not None:
                        value = value.replace(apply_fn=value.attest_apply_fn)
                    full[position] = value
                context = _context.TraceContext(proof, "replay", leaf_values)
                try:
                    with _context.active(context), jax.enable_x64(False):
                        signature.call(full)
                except _context.Boundary as boundary:
                    deltas, params_after, opt_after = boundary.values
                    return (
                        tuple(jax.tree.leaves(deltas)),
                        tuple(jax.tree.leaves(params_after)),
                        tuple(jax.tree.leaves(opt_after)),
                    )
                raise ZKDVError("replay of the staged training step never reached apply_gradients")

            return transition

        return build

    # -- jax.jit compatibility ------------------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: a proof.jit step is compiled by its first call."""
        raise ZKDVError("proof.jit functions are compiled by their first call; call the step")


def _spec(shape: Any, dtype: Any) -> Any:
    return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]


def _flops(compiled: Any) -> float | None:
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - cost analysis is optional on some backends
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    if not analysis:
        return None
    flops = analysis.get("flops")
    return None if flops is None or flops < 0 else float(flops)


class _Step(Submission):
    """One dispatched proof.jit invocation, as the driver pipeline sees it."""

    def __init__(
        self,
        proof: ZKDV,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        host_pre: tuple[list[np.ndarray], list[np.ndarray]] | None,
        snapshot: tuple[list[Any], list[Any]] | None,
    ) -> None:
        traced = program.traced
        nd = traced.delta_leaves
        nparams = len(traced.param_positions)
        self.proof = proof
        self.program = program
        self.index = index
        self.policy = policy
        self.flops = program.flops
        self._deltas: list[Any] | None = list(outputs[:nd])
        self._params: list[Any] | None = list(outputs[nd : nd + nparams])
        self._opt: list[Any] | None = list(outputs[nd + nparams : traced.schema.hidden_leaves])
        self._packed: Any = outputs[traced.schema.hidden_leaves]
        self._batch: np.ndarray | None = None
        self._host_pre = host_pre
        self._snapshot_source = snapshot
        self._views: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] | None = None

    # The driver reads ``snapshot`` on the commit thread and then clears it; reading
    # host views here, not on the training thread, keeps the training thread unblocked.
    @property
    def snapshot(self) -> tuple[Leaves, Leaves, Leaves] | None:
        source = self._snapshot_source
        if source is None:
            return None
        traced = self.program.traced
        return (
            list(zip(traced.param_paths, [np.asarray(a) for a in source[0]], strict=True)),
            list(zip(traced.opt_paths, [np.asarray(a) for a in source[1]], strict=True)),
            [],
        )

    @snapshot.setter
    def snapshot(self, value: Any) -> None:
        if value is None and self._snapshot_source is not None and not self.proof._keep_files:
            self.proof._snapshot_done(self.index)
        self._snapshot_source = None if value is None else self._snapshot_source

    def snapshot_written(self) -> None:
        self.proof._snapshot_done(self.index)

    def initial_state(self) -> tuple[State, State, State]:
        assert self._host_pre is not None
        traced = self.program.traced
        params, opt = self._host_pre
        return (
            list(zip(traced.param_paths, params, strict=True)),
            list(zip(traced.opt_paths, opt, strict=True)),
            [],
        )

    def batch(self) -> np.ndarray:
        if self._batch is None:
            self._batch = np.asarray(self.proof._log.fetch(self.index, "batch", self._packed))
            self._packed = None
            self.proof._keep_batch(self.index, self._batch)
            if self._host_pre is not None and self.index > 0:
                self.proof._verify_continuity(self.index, self._host_pre)
        return self._batch

    def post_state(self) -> tuple[State, State, State]:
        assert self._params is not None and self._opt is not None and self._deltas is not None
        traced = self.program.traced
        params = [np.asarray(leaf) for leaf in self._params]
        opt = [np.asarray(leaf) for leaf in self._opt]
        deltas = [np.asarray(leaf) for leaf in self._deltas]
        self._views = (params, opt, deltas)
        self.proof._log.add(
            self.index, "state", sum(a.nbytes for tree in self._views for a in tree)
        )
        return (
            list(zip(traced.param_paths, params, strict=True)),
            list(zip(traced.opt_paths, opt, strict=True)),
            [],
        )

    def probes(
        self, probes: ProbeSet
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        assert self._views is not None
        params, _, deltas = self._views
        post = probes.project_all(params)
        delta = probes.project_all(deltas)
        if self._host_pre is not None:
            pre = probes.project_all(self._host_pre[0])
        else:
            # The inputs were the previous step's outputs (checked by identity), so
            # their probe is the previous post-update probe.
            previous = self.proof._last_post_probe
            assert previous is not None
            pre = previous
        self.proof._last_post_probe = post
        return pre, post, delta

    def capture(self, challenge: Challenge) -> tuple[float, float]:
        assert self._views is not None
        _, opt, deltas = self._views
        self.proof._expect_check(challenge.step)
        return _select(deltas, challenge.param_index), _select(opt, challenge.state_index)

    def release_views(self) -> None:
        self._views = None
        self._deltas = self._params = self._opt = None
        self._host_pre = None
        self.proof._committed(self.index)

    def replay(self, challenge: Challenge) -> ReplayOutcome:
        return self.proof._replay(challenge)

    def retire(self) -> None:
        self.release_views()
        self._snapshot_source = None
        self.proof._retired(self.index)


class _DeviceStep(_Step):
    """A step whose commitments were dispatched on the device (``commitments='device'``).

    The training thread dispatched the chunk roots and probes of the post-update state
    (and, when the inputs do not continue the previous step, of the pre-update state)
    right after the step; the commit stage reads back only those digests and probes,
    the batch, and the two challenged values. The state itself reaches the host only
    through replay snapshots (:class:`~zkdv.jax._device.SnapshotPool`).
    """

    def __init__(
        self,
        proof: ZKDV,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        snapshot: tuple[list[Any], list[Any]] | None,
        pre: tuple[Any, Any, Any, tuple[Any, Any]] | None,
        post: tuple[Any, Any, Any, Any, tuple[Any, Any]],
    ) -> None:
        super().__init__(proof, program, index, policy, outputs, None, snapshot)
        self._pre = pre
        self._post: tuple[Any, Any, Any, Any, tuple[Any, Any]] | None = post

    @property
    def snapshot(self) -> tuple[Leaves, Leaves, Leaves] | None:
        source = self._snapshot_source
        if source is None:
            return None
        traced = self.program.traced
        # Host-memory arrays: an explicit read, and no device transfer (counted when
        # the copy was launched).
        params, opt = jax.device_get((source[0], source[1]))
        return (
            list(zip(traced.param_paths, [np.asarray(a) for a in params], strict=True)),
            list(zip(traced.opt_paths, [np.asarray(a) for a in opt], strict=True)),
            [],
        )

    @snapshot.setter
    def snapshot(self, value: Any) -> None:
        _Step.snapshot.fset(self, value)  # type: ignore[attr-defined]

    def _device(self) -> DeviceCommitter:
        device = self.proof._device
        assert device is not None
        return device

    def initial_state(self) -> tuple[StateCommitment, StateCommitment, Leaves]:
        assert self._pre is not None
        params, opt, _, (param_specs, opt_specs) = self._pre
        device = self._device()
        return (
            device.commitment(self.index, param_specs, params),
            device.commitment(self.index, opt_specs, opt),
            [],
        )

    def batch(self) -> np.ndarray:
        if self._batch is None:
            self._batch = np.asarray(self.proof._log.fetch(self.index, "batch", self._packed))
            self._packed = None
            self.proof._keep_batch(self.index, self._batch)
            if self._pre is not None and self.index > 0:
                params, opt, _ = self.initial_state()
                self.proof._check_continuity(self.index, params.root, opt.root)
        return self._batch

    def post_state(self) -> tuple[StateCommitment, StateCommitment, Leaves]:
        assert self._post is not None
        params, opt, _, _, (param_specs, opt_specs) = self._post
        device = self._device()
        return (
            device.commitment(self.index, param_specs, params),
            device.commitment(self.index, opt_specs, opt),
            [],
        )

    def probes(
        self, probes: ProbeSet
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        assert self._post is not None
        device = self._device()
        post = device.probe_values(self.index, self._post[2])
        delta = device.probe_values(self.index, self._post[3])
        if self._pre is not None:
            pre = device.probe_values(self.index, self._pre[2])
        else:
            previous = self.proof._last_post_probe
            assert previous is not None
            pre = previous
        self.proof._last_post_probe = post
        return pre, post, delta

    def capture(self, challenge: Challenge) -> tuple[float, float]:
        assert self._deltas is not None and self._opt is not None
        self.proof._expect_check(challenge.step)
        device = self._device()
        return (
            device.element(self.index, self._deltas, challenge.param_index),
            device.element(self.index, self._opt, challenge.state_index),
        )

    def release_views(self) -> None:
        self._pre = self._post = None
        super().release_views()


class ZKDV(Driver):
    """The JAX transcript driver (``zkdv.jax.ZKDV``).

    Args:
        path: proof directory; ``records.cborl``, ``probes.bin``, the program artifact
            and the snapshot and batch files are written there.
        config: run configuration (sampling policy, tolerance, chunk size).
        max_in_flight: hard ceiling for unresolved pipeline transactions.
        replay_snapshot_interval: a full pre-state copy every N steps; a checked
            replay starts at the latest snapshot and replays at most N - 1 transitions.
    """

    distributed = True

    def __init__(
        self,
        path: Any,
        config: ZKDVConfig | None = None,
        *,
        max_in_flight: int = 2,
        replay_snapshot_interval: int = 12,
    ) -> None:
        super().__init__(
            path,
            config,
            backend="jax",
            annotation=_annotation,
            max_in_flight=max_in_flight,
            replay_snapshot_interval=replay_snapshot_interval,
        )
        self._attested: tuple[Callable[..., Any], dict[str, Any]] | None = None
        self._states_created = 0
        self._program_owner: _Program | None = None
        self._artifact: Artifact | None = None
        self._store_lock = threading.Lock()
        self._snapshots: dict[int, tuple[list[Any], list[Any]]] = {}
        self._batches: dict[int, np.ndarray] = {}
        self._checks_pending: set[int] = set()
        self._committed_through = -1
        self._last_outputs: list[weakref.ref[Any]] | None = None
        self._last_post_probe: list[np.ndarray] | None = None
        self._log = TransferLog()
        self._path: str | None = None
        self._device: DeviceCommitter | None = None
        self._pool: SnapshotPool | None = None
        # Pool slots in use by snapshots, and the two events that free them: the
        # snapshot is no longer needed for a replay, and its file is written.
        self._slots: dict[int, list[Any]] = {}
        self._slot_pending: dict[int, int] = {}

    # -- multi-process (rank 0 owns the tape: zkdv.driver) -------------------------------
    def _require_step(self) -> None:
        if not self.follower:
            try:
                self._require_running()
            except ZKDVPoisonedError as error:
                self._announce_failure(error)
                raise
            return
        if self._closed:
            raise ZKDVError(CLOSED)
        if not self._started:
            raise ZKDVError(NOT_STARTED)
        if self._shared_error is not None:
            raise ZKDVPoisonedError(self._shared_error)

    def _announce_failure(self, error: BaseException) -> None:
        """Rank 0 failed before its step: tell the followers, who wait for that step."""
        control = self._control
        if control is None or self.follower or self._shared_error is not None:
            return
        self._shared_error = (
            str(error)
            if isinstance(error, ZKDVPoisonedError)
            else f"rank 0 failed before step {self.steps}: {error}"
        )
        key = f"zkdv.step.{self._entries}"
        self._entries += 1
        with contextlib.suppress(Exception):
            control.exchange(key, self._shared_error)

    # -- public API ---------------------------------------------------------------------
    def jit(self, fun: Callable[..., Any] | None = None, /, **options: Any) -> Any:
        """Compile a training step whose every call is one transcript transaction.

        Accepts every ``jax.jit`` option (``in_shardings``, ``out_shardings``,
        ``static_argnums``, ``static_argnames``, ``donate_argnums``,
        ``donate_argnames``, ``keep_unused``, ``device``, ``backend``, ``inline``,
        ``compiler_options``) and works as a decorator with or without options, or as a
        callable: ``proof.jit(step, donate_argnums=(0,))``.

        Raises:
            TypeError: an option ``jax.jit`` does not have.
        """
        _check_options(options, "ZKDV.jit")
        if fun is None:
            return lambda function: JitFunction(self, function, options)
        return JitFunction(self, fun, options)

    def attest(self, fun: Callable[..., Any] | None = None, /, **options: Any) -> Any:
        """Register the attested program of the explicit ``Transaction`` API.

        Its ABI is fixed: ``(params, opt_state, batch, parameter_index,
        optimizer_state_index) -> (selected_delta, selected_post_optimizer_state)``,
        both outputs scalar floats, both indices ``uint64`` scalars. It is exported with
        ``jax.export`` at the first step and its bytes are committed. ``jax.jit`` options
        apply to it; an explicit ``out_shardings`` is ignored with a warning.

        Returns:
            The function compiled with ``jax.jit`` and the given options.

        Raises:
            ZKDVError: an attested function is already registered.
        """
        _check_options(options, "ZKDV.attest")
        if "out_shardings" in options:
            warnings.warn(
                "ZKDV.attest ignores out_shardings: the attested program's outputs are "
                "two scalars whose layout the protocol fixes",
                stacklevel=2,
            )
            options = {k: v for k, v in options.items() if k != "out_shardings"}

        def register(function: Callable[..., Any]) -> Any:
            if self._attested is not None:
                raise ZKDVError(_messages.ATTEST_TWICE)
            if self._program_owner is not None:
                raise ZKDVError("register the attested function before the first step")
            FunctionSignature(function, "ZKDV.attest")
            self._attested = (function, dict(options))
            return jax.jit(function, **options)

        if fun is None:
            return register
        return register(fun)

    def close(self) -> None:
        """Wait for every commitment and check, write the close record, release resources.

        Raises:
            ZKDVPoisonedError: an asynchronous commitment or sampled check failed.
            ZKDVError: a TrainState was created with this proof but no proof.jit step
                ran (the step still uses ``jax.jit``).
        """
        first = not self._closed
        try:
            super().close()
        finally:
            with self._store_lock:
                self._snapshots.clear()
                self._batches.clear()
                self._slots.clear()
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.close()
        if first and not self.follower and self._states_created and self.steps == 0:
            raise ZKDVError(_messages.NO_TRANSCRIPT_UPDATE)

    @property
    def artifact(self) -> Artifact | None:
        """The committed program artifact (after the first step)."""
        return self._artifact

    @property
    def commitments(self) -> str | None:
        """Where this run's commitments are computed, ``"host"`` or ``"device"``: the
        resolved ``ZKDVConfig.commitments`` (None before the first step)."""
        return self._path

    @property
    def transfers(self) -> TransferLog:
        """Bytes this proof read from the device to the host, per step and kind."""
        return self._log

    # -- frontend internals ----------------------------------------------------------------
    def _note_state(self) -> None:
        self._states_created += 1

    def _install(
        self,
        program: _Program,
        leaves: list[Any],
        replay_builder: Callable[[_Traced], Callable[..., Any]],
    ) -> None:
        """Export and commit the attested program; fix the environment (first step)."""
        traced = program.traced
        validate = traced.layout
        try:
            validate_window(self.rolling_window, validate.cols)
        except ValueError as error:
            raise ValueError(
                f"{error}. The packed batch of this step has {validate.rows} rows of "
                f"{validate.cols} words (docs/jax.md, 'Batch packing'); pass "
                f"proof.start(rolling_window=...) at most {validate.cols}"
            ) from None
        params = [leaves[i] for i in traced.param_positions]
        opt = [leaves[i] for i in traced.opt_positions]
        if jax.process_count() > 1:
            # Every process sees the same global shardings, so all raise here alike.
            split = _unreplicated(params, traced.param_paths) + _unreplicated(opt, traced.opt_paths)
            if split:
                raise ZKDVError(
                    _messages.MULTI_PROCESS_SHARDED.format(
                        count=jax.process_count(), leaves=", ".join(split[:4])
                    )
                )
        if self.follower:
            # Rank 0 exports and commits the program; a follower only runs it.
            self._program_owner = program
            return
        try:
            self._export(program, params, opt, replay_builder)
        except BaseException as error:
            # Only rank 0 exports: the followers, already waiting for this step's
            # decision, must learn that it will not come.
            self._announce_failure(error)
            raise

    def _export(
        self,
        program: _Program,
        params: list[Any],
        opt: list[Any],
        replay_builder: Callable[[_Traced], Callable[..., Any]],
    ) -> None:
        traced = program.traced
        validate = traced.layout
        param_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in params)
        opt_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in opt)
        batch_spec = _spec((validate.rows, validate.cols), jnp.uint32)
        index_spec = _spec((), jnp.uint64)
        registration = traced.registration
        if registration.source != "transaction":
            if self._attested is not None:
                raise ZKDVError(_messages.ATTEST_REGISTERED)
            # zkdv.jax.scan brings its one-update transition; otherwise the staged
            # function is replayed up to its update boundary.
            scan = registration.scan
            generated = scan.transition if scan is not None else replay_builder(traced)
            transition: Callable[..., Any] | None = generated
            attest = _attest_from_transition(generated)
            options: dict[str, Any] = {}
            source = _SOURCES[registration.source] + (" in zkdv.jax.scan" if scan else "")
        else:
            if self._attested is None:
                raise ZKDVError(_messages.NO_ATTEST)
            function, options = self._attested
            attest = _flat_attest(function, traced)
            transition = _derived_transition(function, traced, param_specs, opt_specs, batch_spec)
            source = "ZKDV.attest"
            if transition is None and self.replay_snapshot_interval > 1:
                raise ZKDVError(
                    _messages.NO_TRANSITION.format(
                        interval=self.replay_snapshot_interval,
                        steps=self.replay_snapshot_interval - 1,
                    )
                )
        try:
            exported_attest, exported_transition = _export_programs(
                attest, options, transition, (param_specs, opt_specs, batch_spec, index_spec)
            )
        except ZKDVError:
            raise
        except Exception as error:
            raise ZKDVError(_messages.EXPORT_FAILURE.format(error=error)) from error
        _check_attest_outputs(exported_attest)
        material = dumps(
            source=source,
            attest=exported_attest,
            transition=exported_transition,
            params=list(zip(traced.param_paths, param_specs, strict=True)),
            opt_state=list(zip(traced.opt_paths, opt_specs, strict=True)),
            layout=traced.layout,
        )
        self._set_program("jax.export", material)
        # Replays use the committed bytes themselves, so a check also tests the artifact.
        self._artifact = Artifact.loads(material)
        self._env = _environment()
        shardings = {
            "params": [_describe_sharding(x) for x in params],
            "opt_state": [_describe_sharding(x) for x in opt],
        }
        if any(s is not None for tree in shardings.values() for s in tree):
            self._shardings = shardings
        self._program_owner = program

    def _continues(self, leaves: Sequence[Any]) -> bool:
        references = self._last_outputs
        if references is None or len(references) != len(leaves):
            return False
        return all(reference() is leaf for reference, leaf in zip(references, leaves, strict=True))

    def _step(self, program: _Program, leaves: list[Any], policy: Policy | None) -> Any:
        traced = program.traced
        if policy is None:
            policy = traced.registration.overlap or Policy.UNCHECKED
        state = [leaves[i] for i in traced.param_positions]
        nparams = len(state)
        state += [leaves[i] for i in traced.opt_positions]
        if self._control is None:
            admission = self._admit(policy)
        else:
            agreed = self._agree(policy, barrier=bool(program.donated))
            if agreed is None:  # a follower: run the step, record nothing
                outputs = program.jitted(
                    tuple(leaves[i] for i in program.donated),
                    tuple(leaves[i] for i in program.kept),
                )
                return traced.schema.user_result(outputs, program.trees)
            admission = agreed
        with admission:
            index = self.steps
            device = self._resolve(program, state)
            if device is not None:
                return self._device_step(program, leaves, state, nparams, policy, admission)
            host_pre = None
            if index == 0 or not self._continues(state):
                # The first step's pre-state is the transcript's initial state; a later
                # step whose inputs are not the previous outputs must prove continuity.
                # Either way it is read now, before donation can reuse its buffers.
                copies = _host_copy(state)
                host_pre = (copies[:nparams], copies[nparams:])
                self._log.add(index, "state", sum(a.nbytes for a in copies))
            snapshot = None
            if self._snapshot_due(index):
                if host_pre is not None:
                    snapshot = host_pre
                else:
                    copied = self._snapshot_copy(index, state)
                    snapshot = (copied[:nparams], copied[nparams:])
                with self._store_lock:
                    self._snapshots[index] = snapshot
            if (
                program.donated
                and self._last is not None
                and self._control is None
                and traced.registration.scan is None
            ):
                # The previous commitment may still read host views of the buffers this
                # step donates; with a live view JAX silently skips the donation. (A
                # zkdv.jax.scan call's commitments read only its stacked outputs, never
                # the final state the next call donates.)
                self._barrier()
            outputs = program.jitted(
                tuple(leaves[i] for i in program.donated),
                tuple(leaves[i] for i in program.kept),
            )
            schema = traced.schema
            result = schema.user_result(outputs, program.trees)
            hidden = outputs[traced.delta_leaves : schema.hidden_leaves]
            self._last_outputs = [weakref.ref(leaf) for leaf in hidden]
            scan = traced.registration.scan
            if scan is None:
                step = _Step(self, program, index, policy, outputs, host_pre, snapshot)
                self._submit(admission, step)
            else:
                scan.submit(self, program, index, policy, outputs, host_pre, snapshot, admission)
        return result

    def _device_step(
        self,
        program: _Program,
        leaves: list[Any],
        state: list[Any],
        nparams: int,
        policy: Policy,
        admission: Any,
    ) -> Any:
        """Dispatch one step and its device-side commitments; nothing waits for them.

        No mutation barrier: the commit stage holds no host view of the state, and JAX
        orders every program that reads a buffer before a later one that donates it.
        """
        traced = program.traced
        device = self._device
        assert device is not None
        index = self.steps
        state = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
        params, opt = state[:nparams], state[nparams:]
        pre = None
        if index == 0 or not self._continues(state):
            specs = (leaf_specs(traced.param_paths, params), leaf_specs(traced.opt_paths, opt))
            if index == 0:
                core = self._core
                assert core is not None
                device.start_probes(core.probe_set(specs[0]))
            pre = (device.roots(params), device.roots(opt), device.project(params), specs)
        snapshot = None
        if self._snapshot_due(index):
            copied = self._snapshot_copy(index, state)
            snapshot = (copied[:nparams], copied[nparams:])
            with self._store_lock:
                self._snapshots[index] = snapshot
        outputs = program.jitted(
            tuple(leaves[i] for i in program.donated),
            tuple(leaves[i] for i in program.kept),
        )
        schema = traced.schema
        result = schema.user_result(outputs, program.trees)
        hidden = outputs[traced.delta_leaves : schema.hidden_leaves]
        self._last_outputs = [weakref.ref(leaf) for leaf in hidden]
        nd = traced.delta_leaves
        deltas = list(outputs[:nd])
        params_after = list(outputs[nd : nd + nparams])
        opt_after = list(outputs[nd + nparams : schema.hidden_leaves])
        post = (
            device.roots(params_after),
            device.roots(opt_after),
            device.project(params_after),
            device.project(deltas),
            (
                leaf_specs(traced.param_paths, params_after),
                leaf_specs(traced.opt_paths, opt_after),
            ),
        )
        step = _DeviceStep(self, program, index, policy, outputs, snapshot, pre, post)
        self._submit(admission, step)
        return result

    def _resolve(self, program: _Program, state: list[Any]) -> DeviceCommitter | None:
        """Decide, at the first step, where this run's commitments are computed."""
        if self._path is not None:
            return self._device
        wanted = self.config.commitments
        traced = program.traced
        paths = [*traced.param_paths, *traced.opt_paths]
        arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
        unsupported = DeviceCommitter.unsupported(paths, arrays)
        processes = jax.process_count()
        platforms = {d.platform for x in arrays for d in x.devices()}
        # zkdv.jax.scan returns its updates' states stacked; they are hashed on the host.
        scan = traced.registration.scan is not None
        if wanted == "device":
            if scan:
                raise ZKDVError(_messages.SCAN_DEVICE)
            if processes > 1:
                raise ZKDVError(_messages.DEVICE_MULTI_PROCESS.format(count=processes))
            if unsupported:
                raise ZKDVError(_messages.DEVICE_DTYPES.format(leaves=", ".join(unsupported[:4])))
        elif wanted == "auto":
            # Native BLAKE3 on every core beats XLA's CPU code; on an accelerator the
            # state would otherwise cross PCIe every step.
            accelerated = bool(platforms) and "cpu" not in platforms
            wanted = (
                "device"
                if accelerated and processes == 1 and not unsupported and not scan
                else "host"
            )
        self._path = wanted
        if wanted == "device":
            backend = "cpu" if "cpu" in platforms else "accelerator"
            self._device = DeviceCommitter(
                self.config.chunk_bytes, self._log, default_schedule(backend)
            )
        return self._device

    def _snapshot_copy(self, index: int, state: list[Any]) -> list[Any]:
        """Launch the asynchronous host copy of a replay snapshot (before donation)."""
        self._log.add(index, "snapshot", sum(_nbytes(x) for x in state))
        pool = self._pool
        if pool is None and jax.process_count() == 1:
            arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state]
            shardings = host_shardings(arrays)
            if shardings is not None:
                pool = self._pool = SnapshotPool(arrays, shardings)
        if pool is None:
            return [_to_host(leaf) for leaf in state]
        copied = pool.copy([x if isinstance(x, jax.Array) else jnp.asarray(x) for x in state])
        with self._store_lock:
            self._slots[index] = copied
            self._slot_pending[index] = 2  # still needed for replay; file not written
        return copied

    def _snapshot_done(self, index: int) -> None:
        """The snapshot file of ``index`` is written (or not kept): one use less."""
        with self._store_lock:
            self._release_slot(index)

    def _release_slot(self, index: int) -> None:
        # Called under _store_lock.
        if index not in self._slots:
            return
        self._slot_pending[index] -= 1
        if self._slot_pending[index] > 0:
            return
        del self._slot_pending[index]
        arrays = self._slots.pop(index)
        if self._pool is not None:
            self._pool.release(arrays)

    def _keep_batch(self, index: int, batch: np.ndarray) -> None:
        with self._store_lock:
            self._batches[index] = batch

    def _verify_continuity(
        self, index: int, host_pre: tuple[list[np.ndarray], list[np.ndarray]]
    ) -> None:
        core = self._core
        assert core is not None and core.last_roots is not None
        traced = self._program_owner.traced if self._program_owner else None
        assert traced is not None
        params = core.commit(list(zip(traced.param_paths, host_pre[0], strict=True)))
        opt = core.commit(list(zip(traced.opt_paths, host_pre[1], strict=True)))
        self._check_continuity(index, params.root, opt.root)

    def _check_continuity(self, index: int, params: bytes, opt: bytes) -> None:
        core = self._core
        assert core is not None and core.last_roots is not None
        if params != core.last_roots.params:
            raise ZKDVVerificationError(
                _messages.MODIFIED_OUTSIDE.format(tree="parameters", step=index, previous=index - 1)
            )
        if opt != core.last_roots.opt_state:
            raise ZKDVVerificationError(
                _messages.MODIFIED_OUTSIDE.format(
                    tree="optimizer state", step=index, previous=index - 1
                )
            )

    def _expect_check(self, step: int) -> None:
        with self._store_lock:
            self._checks_pending.add(step)

    def _committed(self, index: int) -> None:
        with self._store_lock:
            self._committed_through = max(self._committed_through, index)
            self._collect()

    def _retired(self, index: int) -> None:
        with self._store_lock:
            self._checks_pending.discard(index)
            self._collect()

    def _collect(self) -> None:
        # A window [s, next) of snapshot s is dropped once all its steps are committed
        # and none of them awaits a check: a check completes asynchronously and must
        # replay from the snapshot that precedes its step, even if newer ones exist.
        steps = sorted(self._snapshots)
        for start, following in itertools.pairwise(steps):
            if self._committed_through < following - 1:
                break
            if any(start <= step < following for step in self._checks_pending):
                continue
            del self._snapshots[start]
            self._release_slot(start)
            for step in range(start, following):
                self._batches.pop(step, None)

    def _replay(self, challenge: Challenge) -> ReplayOutcome:
        interval = self.replay_snapshot_interval
        start = challenge.step - challenge.step % interval
        with self._store_lock:
            params, opt = self._snapshots[start]
            batches = [self._batches[step] for step in range(start, challenge.step + 1)]
        artifact = self._artifact
        assert artifact is not None
        params, opt = jax.device_get((list(params), list(opt)))
        delta, state = artifact.replay(
            [np.asarray(leaf) for leaf in params],
            [np.asarray(leaf) for leaf in opt],
            batches,
            challenge.param_index,
            challenge.state_index,
        )
        return ReplayOutcome(delta, state, start, challenge.step - start)


def _environment() -> dict[str, Any]:
    import jaxlib

    env: dict[str, Any] = {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "jax_platform": jax.default_backend(),
        "devices": sorted({device.device_kind for device in jax.devices()}),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "x64": bool(getattr(jax.config, "jax_enable_x64", False)),
    }
    for name in ("flax", "optax"):
        with contextlib.suppress(ImportError):
            env[name] = __import__(name).__version__
    return env


# A transcript is replayed where the platform has accelerators, often not where it was
# trained (or the reverse), so programs are lowered for the training platform and the
# common ones when their operations allow it (jax.export multi-platform lowering).
# ZKDV_JAX_EXPORT_PLATFORMS (comma-separated; empty: the training platform only) overrides.
REPLAY_PLATFORMS = ("cpu", "cuda")


def _replay_platforms() -> tuple[str, ...]:
    configured = os.environ.get("ZKDV_JAX_EXPORT_PLATFORMS")
    if configured is None:
        return REPLAY_PLATFORMS
    return tuple(p.strip() for p in configured.split(",") if p.strip())


def _export_programs(
    attest: Callable[..., Any],
    options: dict[str, Any],
    transition: Callable[..., Any] | None,
    specs: tuple[Any, Any, Any, Any],
) -> tuple[export.Exported, export.Exported | None]:
    params, opt, batch, index_spec = specs
    local = jax.default_backend()
    extra = tuple(p for p in dict.fromkeys(_replay_platforms()) if p != local)
    candidates = [(local, *extra), (local,)] if extra else [(local,)]
    failure: Exception | None = None
    for platforms in candidates:
        try:
            with jax.enable_x64(True):
                attested = export.export(jax.jit(attest, **options), platforms=platforms)(
                    params, opt, batch, index_spec, index_spec
                )
                full = (
                    None
                    if transition is None
                    else export.export(jax.jit(transition), platforms=platforms)(params, opt, batch)
                )
            return attested, full
        except ZKDVError:
            raise
        except Exception as error:  # noqa: BLE001 - retried for the local platform only
            failure = error
    assert failure is not None
    raise failure


def _attest_from_transition(transition: Callable[..., Any]) -> Callable[..., Any]:
    def attest(
        params: tuple[Any, ...], opt_state: tuple[Any, ...], batch: Any, p: Any, s: Any
    ) -> tuple[Any, Any]:
        deltas, _, opt_after = transition(params, opt_state, batch)
        return index(deltas, p), index(opt_after, s)

    return attest


def _unflatten_inputs(traced: _Traced, params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
    batch_leaves = traced.layout.unpack(batch)
    return (
        jax.tree.unflatten(traced.param_tree, list(params)),
        jax.tree.unflatten(traced.opt_tree, list(opt_state)),
        jax.tree.unflatten(traced.batch_tree, batch_leaves),
    )


def _flat_attest(function: Callable[..., Any], traced: _Traced) -> Callable[..., Any]:
    def attest(
        params: tuple[Any, ...], opt_state: tuple[Any, ...], batch: Any, p: Any, s: Any
    ) -> tuple[Any, Any]:
        trees = _unflatten_inputs(traced, params, opt_state, batch)
        with jax.enable_x64(False):
            outputs = function(*trees, p, s)
        if not isinstance(outputs, tuple | list) or len(outputs) != 2:
            raise ZKDVError(_messages.ATTEST_OUTPUTS.format(got=type(outputs).__name__))
        return outputs[0], outputs[1]

    return attest


def _derived_transition(
    function: Callable[..., Any],
    traced: _Traced,
    param_specs: Any,
    opt_specs: Any,
    batch_spec: Any,
) -> Callable[..., Any] | None:
    """Derive the full transition from the trees the attested function indexes."""

    def collect(
        params: tuple[Any, ...], opt_state: tuple[Any, ...], batch: Any
    ) -> tuple[Any, Any, Any]:
        trees = _unflatten_inputs(traced, params, opt_state, batch)
        with _context.collecting() as recorded, jax.enable_x64(False):
            zero = jnp.zeros((), jnp.uint32)
            function(*trees, zero, zero)
        deltas = next(
            (t for t in recorded if _same_layout(t, traced.param_tree, param_specs)), None
        )
        opt_after = next((t for t in recorded if _same_layout(t, traced.opt_tree, opt_specs)), None)
        if deltas is None or opt_after is None:
            raise _NoTransition
        params_tree = jax.tree.unflatten(traced.param_tree, list(params))
        after = jax.tree.map(
            lambda p, d: jnp.asarray(p + d).astype(jnp.asarray(p).dtype), params_tree, deltas
        )
        return (
            tuple(jax.tree.leaves(deltas)),
            tuple(jax.tree.leaves(after)),
            tuple(jax.tree.leaves(opt_after)),
        )

    try:
        with jax.enable_x64(True):
            jax.eval_shape(collect, param_specs, opt_specs, batch_spec)
    except _NoTransition:
        return None
    return collect


class _NoTransition(Exception):  # noqa: N818 - internal signal
    pass


def _same_layout(tree: Any, structure: Any, specs: Sequence[Any]) -> bool:
    if jax.tree.structure(tree) != structure:
        return False
    return all(
        jnp.shape(leaf) == spec.shape
        for leaf, spec in zip(jax.tree.leaves(tree), specs, strict=True)
    )


def _check_attest_outputs(exported: export.Exported) -> None:
    avals = exported.out_avals
    if len(avals) != 2 or any(
        aval.shape != () or not jnp.issubdtype(aval.dtype, jnp.floating) for aval in avals
    ):
        raise ZKDVError(_messages.ATTEST_OUTPUTS.format(got=", ".join(str(aval) for aval in avals)))
