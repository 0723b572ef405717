"""``proof.jit``: the compiled production program of a training step.

:class:`JitFunction` is what ``proof.jit`` returns. Its first call traces the user's
step once with a :class:`~zkdv.jax._context.TraceContext` installed, learns the
transaction it declares (:class:`_Traced`), and compiles one program that returns the
user's result *and* the transaction's hidden values (deltas, post-update parameters and
optimizer state, the packed uint32 batch and, in a run that commits its gradients, the
step's computed values; laid out by :class:`~zkdv.compilation.ResultSchema`).
``JitFunction._build`` runs the named steps: argument layout and donation, tracing,
lowering with the user's shardings, and handing the :class:`_Program` to the driver
(:mod:`zkdv.jax._driver`), which exports and commits the attested program from it.
Every call after the first checks that the arguments still fit the program and runs it
through the driver.

The program takes a third input, ``zero``: a uint32 0 at run time that the canonical
optimizer update (:mod:`zkdv.jax.canonical`) needs as a program input. A run commits
its gradients (:mod:`zkdv.jax._optimizer`) when its update is an Optax transformation applied
through ``TrainState``, an NNX ``Optimizer`` or ``Transaction.apply``, and its state
has no ``attest_apply_fn``; the driver then trains with the *exported* production
program, deserialized from the committed artifact, which is also what the platform's
replay runs (a state sharded over devices, of one process or several: the traced
programs partitioned by XLA, :func:`zkdv.jax._export.step_calls`). A ``zkdv.jax.scan``
with updates inside commits each update's gradient too, but trains with this program
(the loop, whose body applies the canonical update) and commits one update's programs
(:mod:`zkdv.jax._scan`); ``_Traced.update`` is then None.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from zkdv.batch import count_tokens
from zkdv.compilation import ResultSchema, jax_trees
from zkdv.errors import (
    ZKDVError,
)
from zkdv.gradients import leaf_name
from zkdv.jax import _context, _messages, _optimizer
from zkdv.jax._flops import matmul_flops
from zkdv.jax._sharding import (
    constrain,
    is_sharding_leaf,
    layout_of,
    output_shardings,
    pin,
    replicated,
    spans_devices,
)
from zkdv.jax._tree import BatchLayout, leaf_paths
from zkdv.overlap import Policy
from zkdv.signature import FunctionSignature
from zkdv.transaction import bind_input

if TYPE_CHECKING:
    from zkdv.driver import Runtime

__all__ = ["JIT_OPTIONS", "JitFunction"]

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


def _check_options(options: dict[str, Any], api: str) -> None:
    unknown = sorted(set(options) - JIT_OPTIONS)
    if unknown:
        raise TypeError(f"{api} got unexpected jax.jit options {unknown}")


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
    #: The optimizer update of a run that commits its gradients; None otherwise.
    update: _optimizer.UpdateSpec | None = None
    #: The computed values' names (``schema.grad`` order), when ``update`` is set.
    computed_names: tuple[str, ...] = ()

    @property
    def commits(self) -> bool:
        """Whether the run commits its gradients (the program returns computed values)."""
        return self.update is not None


@dataclass(frozen=True)
class _Arguments:
    """How one call's arguments map onto the program's flat leaves."""

    values: list[Any]
    dynamic_positions: list[int]
    leaves: list[Any]
    in_tree: Any
    donated: tuple[int, ...]
    kept: tuple[int, ...]

    def rebuild(self, leaf_values: list[Any]) -> list[Any]:
        """The call's arguments with the dynamic ones rebuilt from ``leaf_values``."""
        dynamic = jax.tree.unflatten(self.in_tree, leaf_values)
        full = list(self.values)
        for position, value in zip(self.dynamic_positions, dynamic, strict=True):
            full[position] = value
        return full


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
        #: The runtime zero of the canonical fences, passed at every call.
        self.zero: Any = jnp.zeros((), jnp.uint32)
        #: In a run that commits gradients: the production function's trace (``jitted``
        #: traced it without donation) and input specs, which the driver exports; then
        #: ``jitted`` is the exported program's compiled call and ``apply`` the committed
        #: apply program's, or, where the arguments lie on several devices
        #: (``spans_devices``), both partitioned by XLA (``_export.step_calls``). With
        #: ``host_deltas`` (commitments on the host, one process) the commit stage forms the delta probes from the probed
        #: rows, and ``apply`` writes the post-update parameters into the pre-update
        #: ones' buffers when the step donates them; otherwise ``deltas`` is the realized
        #: changes' program, run after it, which donates them instead.
        self.trace: Any = None
        self.specs: tuple[Any, Any, Any] | None = None
        self.spans_devices = False
        #: Under several processes, the production step traced without their mesh:
        #: what the driver exports (None: ``jitted`` itself).
        self.exported_from: Any = None
        self.apply: Any = None
        self.deltas: Any = None
        self.host_deltas = False
        self._tokens: dict[str, int] = {}

    def tokens(self, unit: str) -> int:
        """One update's ``tokens`` in ``unit`` (:func:`zkdv.batch.count_tokens`), from the
        shapes of its batch inputs (a PRNG key or scalar shared by every row aside)."""
        if unit not in self._tokens:
            leaves = self.traced.layout.leaves
            self._tokens[unit] = count_tokens(
                [(leaf.shape, leaf.dtype) for leaf in leaves if not leaf.shared], unit
            )
        return self._tokens[unit]


class Host(Protocol):
    """What a ``proof.jit`` function needs from the driver that made it
    (:class:`zkdv.jax.ZKDV`): the shared runtime, the program already compiled for the
    run (one per proof), the install of the attested program at the first call, and the
    dispatch of each step. Stated here so that this module does not import the driver.
    """

    _program_owner: _Program | None

    @property
    def runtime(self) -> Runtime: ...

    def _install(
        self,
        program: _Program,
        leaves: list[Any],
        replay_builder: Callable[[_Traced], Callable[..., Any]],
    ) -> None: ...

    def _step(self, program: _Program, leaves: list[Any], policy: Policy | None) -> Any: ...


class JitFunction:
    """A ``proof.jit``-compiled training step: one transcript transaction per call."""

    def __init__(self, proof: Host, function: Callable[..., Any], options: dict[str, Any]):
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
                    self._graphs = _nnx.GraphFunction(
                        self._function,
                        self._signature,
                        self._donate,
                        lambda pure: JitFunction(self._proof, pure, self._options),
                    )
            return self._graphs(*args, **kwargs)
        proof = self._proof
        proof.runtime.require_step()
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
        """Compile the production program on the first call, in four named steps."""
        proof = self._proof
        if proof._program_owner is not None:
            raise ZKDVError(
                _messages.INCOMPATIBLE.format(
                    detail="this proof already compiled another proof.jit function; one "
                    "proof records one training step function"
                )
            )
        arguments = self._arguments(values, fixed, leaves, in_tree)
        holder: dict[str, _Traced] = {}
        commits = _commitable(values, leaves)
        production = self._production(arguments, holder, commits=commits)
        jitted, _, trace = self._compile(production, arguments, holder, commits=commits)
        traced = holder["traced"]
        program = _Program(
            self,
            jitted,
            traced,
            arguments.donated,
            arguments.kept,
            [(tuple(jnp.shape(leaf)), jnp.result_type(leaf)) for leaf in leaves],
            matmul_flops(trace.jaxpr),
            static_key,
        )
        program.function_tree = in_tree
        if traced.commits:
            program.trace = trace
            program.specs = _input_specs(arguments)
            program.spans_devices = spans_devices(leaves)
            if jax.process_count() > 1:
                # The committed programs run on one device: export the step traced on
                # the global shapes without the processes' mesh (nothing gathered).
                options = {n: self._options[n] for n in _PASSTHROUGH if n in self._options}
                unsharded = self._production(arguments, {}, commits=True, gather=False)
                program.exported_from = jax.jit(unsharded, **options)
        replay = self._replay_builder(values, arguments.dynamic_positions, in_tree)
        proof._install(program, leaves, replay)
        return program

    def _arguments(
        self, values: list[Any], fixed: frozenset[int], leaves: list[Any], in_tree: Any
    ) -> _Arguments:
        """Step 1: which leaves belong to which dynamic argument, and which are donated."""
        dynamic_positions = [i for i in range(len(values)) if i not in fixed]
        donated: list[int] = []
        start = 0
        for position in dynamic_positions:
            value = values[position]
            size = len(jax.tree.leaves(value))
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
        return _Arguments(
            values=values,
            dynamic_positions=dynamic_positions,
            leaves=leaves,
            in_tree=in_tree,
            donated=tuple(donated),
            kept=tuple(i for i in range(len(leaves)) if i not in donated_set),
        )

    def _production(
        self,
        arguments: _Arguments,
        holder: dict[str, _Traced],
        *,
        commits: bool,
        gather: bool = True,
    ) -> Callable[[tuple[Any, ...], tuple[Any, ...], Any], Any]:
        """Step 2: the function JAX traces: the user's step plus the hidden values.

        Tracing it fills ``holder["traced"]`` with what the trace learned. With
        ``commits`` the trace records the step's optimizer update, so that the run can
        commit its gradient (:mod:`zkdv.jax._optimizer`). Under several processes the
        step gathers what rank 0 commits onto the global mesh; without ``gather`` it
        does not (the program exported for one device, :meth:`_build`).
        """
        proof = self._proof
        signature = self._signature
        trees = jax_trees()
        leaves = arguments.leaves
        count = len(leaves)
        donated, kept = arguments.donated, arguments.kept
        donated_set = frozenset(donated)
        gathered = replicated(leaves) if gather and jax.process_count() > 1 else None

        def production(
            donated_leaves: tuple[Any, ...], kept_leaves: tuple[Any, ...], zero: Any
        ) -> Any:
            leaf_values: list[Any] = [None] * count
            for i, position in enumerate(donated):
                leaf_values[position] = donated_leaves[i]
            for i, position in enumerate(kept):
                leaf_values[position] = kept_leaves[i]
            capture = _optimizer.Capture(zero) if commits else None
            context = _context.TraceContext(proof, "production", leaf_values, capture=capture)
            with _context.active(context):
                result = signature.call(arguments.rebuild(leaf_values))
            traced = self._registered(
                context, leaf_values, donated_set, arguments.in_tree, arguments.values
            )
            computed: list[Any] = []
            if traced.update is not None:
                computed = traced.registration.computed
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
                packed, computed, hidden = _gather(
                    traced, leaves, gathered, (packed, computed, hidden)
                )
            extra = [packed, *computed] if scan is None else [packed, *scan.stacked]
            schema, flat = ResultSchema.build(
                result, hidden, trees, delta_leaves=traced.delta_leaves, extra=extra
            )
            traced.schema = schema
            holder["traced"] = traced
            if traced.commits:
                # The state after the step is the apply program's: the hidden values are
                # not outputs, and XLA drops the update this trace computed for them.
                return tuple(flat[schema.hidden_leaves :])
            return tuple(flat)

        return production

    def _compile(
        self,
        production: Callable[[tuple[Any, ...], tuple[Any, ...], Any], Any],
        arguments: _Arguments,
        holder: dict[str, _Traced],
        *,
        commits: bool,
    ) -> tuple[Any, Any, Any]:
        """Step 3: trace and compile with the user's ``jax.jit`` options and shardings.

        Returns:
            The jitted function, its compiled executable and its trace. For a run that
            commits its gradients the function is traced without donation (the apply
            program reads the parameters after it) and the executable is None: the
            driver exports the traced program and compiles the export.
        """
        leaves, donated, kept = arguments.leaves, arguments.donated, arguments.kept
        shardings = self._leaf_shardings(arguments.values, arguments.dynamic_positions, leaves)
        options: dict[str, Any] = {
            name: self._options[name] for name in _PASSTHROUGH if name in self._options
        }
        if shardings is not None:
            options["in_shardings"] = (
                tuple(shardings[i] for i in donated),
                tuple(shardings[i] for i in kept),
                None,
            )
        args = (
            tuple(leaves[i] for i in donated),
            tuple(leaves[i] for i in kept),
            jnp.zeros((), jnp.uint32),
        )
        if commits:
            jitted = jax.jit(production, **options)
            traced_from = jitted.trace(*args)
            if holder["traced"].commits:
                return jitted, None, traced_from
        donate_argnums = (0,) if donated else ()
        jitted = jax.jit(production, donate_argnums=donate_argnums, **options)
        traced_from = jitted.trace(*args)
        out_shardings = self._options.get("out_shardings")
        if out_shardings is not None:
            # The flat output layout is known only after tracing; map the user's
            # result shardings onto it and trace once more with them.
            per_output = output_shardings(out_shardings, holder["traced"].schema)
            jitted = jax.jit(
                production, donate_argnums=donate_argnums, out_shardings=per_output, **options
            )
            traced_from = jitted.trace(*args)
        return jitted, traced_from.lower().compile(), traced_from

    def _leaf_shardings(
        self, values: list[Any], dynamic_positions: list[int], leaves: list[Any]
    ) -> list[Any] | None:
        in_shardings = self._options.get("in_shardings")
        if in_shardings is None:
            return None
        if is_sharding_leaf(in_shardings) and in_shardings is not None:
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
            if is_sharding_leaf(entry):
                out.extend([entry] * len(jax.tree.leaves(value)))
            else:
                broadcast = jax.tree.broadcast(entry, value, is_leaf=is_sharding_leaf)
                out.extend(jax.tree.leaves(broadcast, is_leaf=is_sharding_leaf))
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
            if registration.recorded is not None:
                batch_positions = _batch_inputs(leaf_values, registration.batch, state_positions)
        param_paths = leaf_paths(registration.params_before, "params")
        opt_paths = leaf_paths(registration.opt_before, "opt_state")
        update = None
        names: tuple[str, ...] = ()
        if registration.recorded is not None and registration.scan is None:
            update, names = _declared_update(registration, param_paths, opt_paths)
        return _Traced(
            registration=registration,
            schema=None,  # type: ignore[arg-type]  # set right after
            layout=layout,
            param_positions=params.leaves,
            opt_positions=opt.leaves,
            batch_positions=batch_positions,
            param_paths=param_paths,
            opt_paths=opt_paths,
            param_tree=param_tree,
            opt_tree=opt_tree,
            batch_tree=batch_tree,
            delta_leaves=len(jax.tree.leaves(registration.deltas)),
            update=update,
            computed_names=names,
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


def _commitable(values: list[Any], leaves: list[Any]) -> bool:
    """Whether a step on these arguments can commit its gradients (see the module docstring).

    A state whose replay substitutes ``attest_apply_fn`` for an ``apply_fn`` that
    cannot be exported keeps the older path. A state sharded over devices, this
    process's or several processes', commits its gradients
    (:func:`zkdv.jax._export.step_calls`).
    """
    from zkdv.jax.contrib import TrainState

    for value in values:
        states = jax.tree.leaves(value, is_leaf=lambda node: isinstance(node, TrainState))
        if any(isinstance(s, TrainState) and s.attest_apply_fn is not None for s in states):
            return False
    return True


def _gather(
    traced: _Traced, leaves: list[Any], gathered: Sharding, values: tuple[Any, list[Any], Any]
) -> tuple[Any, list[Any], Any]:
    """What rank 0 commits, laid out so that it reads it whole (several processes).

    ``values`` is the packed batch, the computed values and the hidden values. The
    batch and the gradient are all-gathered inside the step. The committed state keeps
    its input layouts, which ``_install`` checked are whole on every process, so rank 0
    reads it without a collective: in a run that commits its gradients it is the apply
    program's (not an output here; pinning it would part the result from the values it
    aliases), otherwise pinned to those layouts.
    """
    packed, computed, hidden = values
    packed = constrain(packed, gathered)
    if traced.commits:
        return packed, [constrain(value, gathered) for value in computed], hidden
    param_layouts = [layout_of(leaves[i], gathered) for i in traced.param_positions]
    opt_layouts = [layout_of(leaves[i], gathered) for i in traced.opt_positions]
    hidden = (
        pin(hidden[0], param_layouts, gathered),
        pin(hidden[1], param_layouts, gathered),
        pin(hidden[2], opt_layouts, gathered),
    )
    return packed, computed, hidden


def _batch_inputs(leaf_values: list[Any], batch: Any, state: set[int]) -> tuple[int, ...]:
    """Input positions of a transaction's batch leaves, which must cover every other input.

    The platform rebuilds the step's inputs from the committed state and batch alone.
    """
    positions = {id(leaf): index for index, leaf in enumerate(leaf_values)}
    found = tuple(positions.get(id(leaf), -1) for leaf in jax.tree.leaves(batch))
    missing = set(range(len(leaf_values))) - state - set(found)
    if -1 in found or missing:
        raise ZKDVError(_messages.TRANSACTION_BATCH.format(count=max(len(missing), 1)))
    return found


def _declared_update(
    registration: _context.Registration, param_paths: list[str], opt_paths: list[str]
) -> tuple[_optimizer.UpdateSpec, tuple[str, ...]]:
    """The recorded optimizer update as an :class:`~zkdv.jax._optimizer.UpdateSpec`.

    Also sets the registration's computed values (traced), and returns their names.
    """
    params_before = jax.tree.leaves(registration.params_before)
    params_after = jax.tree.leaves(registration.params_after)
    spec, computed = _optimizer.describe(
        registration.recorded,
        params_before,
        params_after,
        jax.tree.leaves(registration.opt_before),
        jax.tree.leaves(registration.opt_after),
        counters=registration.counters,
        overwrite=registration.overwrite,
    )
    registration.computed = computed
    names = tuple(leaf_name("params", param_paths[p]) for p in spec.grads) + tuple(
        leaf_name("opt_state", opt_paths[p]) for p in spec.carried
    )
    return spec, names


def _input_specs(arguments: _Arguments) -> tuple[Any, Any, Any]:
    """The production program's input specs (weak types kept, as the trace saw them)."""

    def spec(leaf: Any) -> Any:
        aval = jax.typeof(leaf)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)  # type: ignore[no-untyped-call]

    leaves = arguments.leaves
    return (
        tuple(spec(leaves[i]) for i in arguments.donated),
        tuple(spec(leaves[i]) for i in arguments.kept),
        jax.ShapeDtypeStruct((), jnp.uint32),  # type: ignore[no-untyped-call]
    )
