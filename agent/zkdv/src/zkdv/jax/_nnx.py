"""Flax NNX under ``proof.jit``: the decorator replaces ``nnx.jit``.

A Flax NNX training step takes graph objects (an ``nnx.Module``, an ``nnx.Optimizer``,
metrics) and mutates them in place; ``nnx.jit`` lifts it over ``nnx.split`` and
``nnx.merge``. :class:`GraphFunction` does the same around ``proof.jit``'s machinery:

* each argument that is an NNX object (an ``nnx.Pytree``: modules, optimizers,
  metrics) is split into its graph definition (static, part of the compiled program)
  and its state (dynamic leaves; typed PRNG keys travel as their key data, so RNG
  streams are committed as uint32 words), wrapped in a :class:`Graph` pytree;
* the staged function merges them back, calls the user's step, splits the objects
  again and returns their new state beside the user's result; the caller's objects are
  updated in place afterwards (their own ``Variable``s are set), as ``nnx.jit`` does;
* the transaction is ``optimizer.update(model, grads)``: while the step runs, every
  ``nnx.Optimizer`` among the arguments has its ``tx`` wrapped, so the call reveals the
  parameters (``nnx.state(model, wrt)``, the optimizer's ``wrt`` filter) by identity.
  In a run that commits its gradients the wrapper is :func:`zkdv.jax.optimizer`: the
  gradient ``tx.update`` receives is committed, and the optimizer's ``update`` is
  wrapped too, so that the parameters it writes are the ones the capture recorded
  (:meth:`~zkdv.jax._optimizer.Capture.apply_updates`). The model's other state the
  step writes (``BatchStat``, RNG counts) is the step's carried values; the optimizer's
  ``step`` is its counter. The post-update state the step commits is then the apply
  program's (:mod:`zkdv.jax._optimizer`): the update traced here is dead code.
  The **parameters** are those leaves; the **optimizer-state continuity tree** is
  every other leaf of the arguments holding the model and the optimizer: the
  optimizer's ``step`` and Optax state, and the model's other variables (BatchNorm
  statistics, RNG counts and keys, frozen parameters outside ``wrt``). Deltas are the
  realized ``after - before`` of every parameter (float32 below float32). Every other
  dynamic input (the batch, metrics' state, other arguments) is the committed batch.

The post-update state is the objects' state when the step returns, so the attested
transition is the whole step (what ``Boundary`` cuts off is only the user's result).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zkdv.errors import ZKDVError
from zkdv.jax import _context, _messages, _optimizer

if TYPE_CHECKING:
    from zkdv.signature import FunctionSignature

__all__ = ["Graph", "GraphFunction", "has_graph_nodes"]


def is_graph_node(value: Any) -> bool:
    """Whether ``value`` is a Flax NNX object ``proof.jit`` splits and updates in place."""
    return isinstance(value, nnx.Pytree)


def has_graph_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(is_graph_node(value) for value in (*args, *kwargs.values()))


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@jax.tree_util.register_pytree_node_class
class Graph:
    """One NNX argument as a pytree: graph definition (static) and state (leaves).

    Typed PRNG key leaves are held as their key data (``keys`` names their
    implementations, in leaf order), so every committed leaf is a plain array.
    """

    def __init__(self, graphdef: Any, state: Any, keys: tuple[str | None, ...]) -> None:
        self.graphdef = graphdef
        self.state = state
        self.keys = keys
        # Leaves a donated argument may donate (its parameters); host-side only.
        self.donatable: list[Any] = []
        # The object's own Variables, in leaf order, when every leaf is one (host-side:
        # nnx.split hands out the object's Variables, so setting them updates it).
        self.variables: list[Any] | None = None

    def tree_flatten(self) -> tuple[tuple[Any], tuple[Any, tuple[str | None, ...]]]:
        return (self.state,), (self.graphdef, self.keys)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, tuple[str | None, ...]], children: Any) -> Graph:
        return cls(aux[0], children[0], aux[1])

    def _zkdv_donatable(self) -> list[Any]:
        return self.donatable

    def merge(self) -> Any:
        """The NNX object (keys rewrapped); traceable."""
        leaves, structure = jax.tree.flatten(self.state)
        leaves = [
            leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
            for leaf, impl in zip(leaves, self.keys, strict=True)
        ]
        return nnx.merge(self.graphdef, jax.tree.unflatten(structure, leaves))


def _split(node: Any, known: dict[int, tuple[Any, Any]] | None = None) -> Graph:
    """Split an NNX object into a :class:`Graph`; ``known`` maps keys to their data."""
    graphdef, state = nnx.split(node)
    leaves, structure = jax.tree.flatten(state)
    keys: list[str | None] = []
    converted: list[Any] = []
    for leaf in leaves:
        if _is_key(leaf):
            keys.append(str(jax.random.key_impl(leaf)))
            cached = None if known is None else known.get(id(leaf))
            # The data array the previous step returned for this key, so a state that
            # continues from that step is recognised by identity.
            converted.append(
                cached[1] if cached is not None and cached[0] is leaf else jax.random.key_data(leaf)
            )
        else:
            keys.append(None)
            converted.append(leaf)
    graph = Graph(graphdef, jax.tree.unflatten(structure, converted), tuple(keys))
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) == len(leaves) and all(isinstance(v, nnx.Variable) for v in variables):
        graph.variables = variables
    return graph


@dataclass
class _Update:
    """What ``optimizer.update(model, grads)`` revealed while the step was traced."""

    params: Any  # the parameter arrays tx.update received (a tree)
    optimizer: Any
    #: The optimizer's step counter before the update (a leaf of its state).
    step: Any = None
    #: The recorded update, when the run commits its gradient.
    recorded: Any = None


@contextmanager
def _intercepted(objects: list[Any], found: list[_Update]) -> Iterator[None]:
    """Wrap the ``tx`` of every ``nnx.Optimizer`` in ``objects`` to record its update."""
    trace = _context.trace_state()
    wrapped: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for obj in objects:
        for _, node in nnx.iter_graph(obj):
            if isinstance(node, nnx.Optimizer) and id(node) not in seen:
                seen.add(id(node))
                wrapped.append((node, node.tx))
    try:
        for optimizer, tx in wrapped:
            optimizer.tx = _recording(tx, optimizer, found, trace)
            # Shadows the class's method; set around NNX's __setattr__, which would record
            # a new attribute in the object's graph structure.
            object.__setattr__(optimizer, "update", _recorded_update(optimizer, found))
        yield
    finally:
        for optimizer, tx in wrapped:
            optimizer.tx = tx
            if "update" in vars(optimizer):
                object.__delattr__(optimizer, "update")


def _recording(
    tx: Any, optimizer: Any, found: list[_Update], trace: Any
) -> optax.GradientTransformationExtraArgs:
    committed = _optimizer.optimizer(tx)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if _context.trace_state() != trace:
            raise ZKDVError(_messages.NESTED_UPDATE)
        if found:
            raise ZKDVError(_context.ONE_TRANSACTION)
        step = optimizer.step.get_value() if hasattr(optimizer, "step") else None
        found.append(_Update(params, optimizer, step))
        # Recorded and canonical in a production trace that commits gradients.
        return committed.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def _recorded_update(optimizer: Any, found: list[_Update]) -> Callable[..., Any]:
    """``optimizer.update`` whose new parameters the trace's capture records.

    Flax's method applies the updates with ``optax.apply_updates`` where the capture
    cannot see it; in a trace that commits gradients the parameters are then set again
    to the same sum, taken through the capture, which identifies them as the update's.
    """
    method = type(optimizer).update

    def update(*args: Any, **kwargs: Any) -> Any:
        result = method(optimizer, *args, **kwargs)
        # ``update(model, grads)``; an ``nnx.ModelAndOptimizer`` holds its model.
        model = args[0] if len(args) > 1 else getattr(optimizer, "model", None)
        context = _context.current()
        capture = None if context is None else context.capture
        recorded = None if capture is None else capture.recorded
        if capture is not None and recorded is not None and found[-1].optimizer is optimizer:
            nnx.update(model, capture.apply_updates(recorded.params, recorded.updates))
            found[-1].recorded = recorded
        return result

    return update


def _delta(before: Any, after: Any) -> Any:
    # The realized change: exact for nearby float32/float64 values (Sterbenz), and
    # float32 below that so the probe identity post = pre + delta holds.
    dtype = jnp.dtype(after.dtype)
    wide = dtype if dtype in (jnp.float32, jnp.float64) else jnp.float32
    return jnp.asarray(after).astype(wide) - jnp.asarray(before).astype(wide)


def _filtered(tree: Any, keep: Callable[[Any], bool]) -> Any:
    """A nested dict of the leaves of a pure-dict ``tree`` that ``keep`` accepts."""
    if isinstance(tree, dict):
        out = {key: _filtered(value, keep) for key, value in tree.items()}
        return {key: value for key, value in out.items() if not _empty(value)}
    return tree if keep(tree) else {}


def _empty(value: Any) -> bool:
    return isinstance(value, dict) and not value


class GraphFunction:
    """A ``proof.jit`` function called with Flax NNX objects (see the module docstring)."""

    def __init__(
        self,
        function: Callable[..., Any],
        signature: FunctionSignature,
        donate: frozenset[int],
        jit: Callable[[Callable[..., Any]], Callable[..., Any]],
    ) -> None:
        """Wrap ``function`` (a ``proof.jit`` function's, with its signature and donated
        positions); ``jit`` makes the ``proof.jit`` function of the pure step."""
        self._function = function
        self._names = signature.names
        self._signature = signature
        self._donate = donate
        self.inner = jit(self._pure())
        self._graphdefs: dict[int, Any] = {}
        self._keys: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()
        self._discovered = False

    # -- host side --------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = list(self._signature.bind(*args, **kwargs))
        nodes = {i: value for i, value in enumerate(values) if is_graph_node(value)}
        inputs: list[Graph] = []
        for position, node in nodes.items():
            graph = _split(node, self._keys)
            inputs.append(graph)
            first = self._graphdefs.setdefault(position, graph.graphdef)
            if graph.graphdef != first:
                raise ZKDVError(
                    _messages.INCOMPATIBLE.format(
                        detail=f"the structure of the Flax NNX argument "
                        f"{self._names[position]!r} changed since the first step"
                    )
                )
            values[position] = graph
        if not self._discovered:
            with self._lock:
                if not self._discovered:
                    self._check_shared(nodes)
                    self._discover(values, nodes)
                    self._discovered = True
        result, states = self.inner(*values)
        keys: dict[int, tuple[Any, Any]] = {}
        for node, before, graph in zip(nodes.values(), inputs, states, strict=True):
            leaves, structure = jax.tree.flatten(graph.state)
            restored = []
            for leaf, impl in zip(leaves, graph.keys, strict=True):
                if impl is None:
                    restored.append(leaf)
                    continue
                key = jax.random.wrap_key_data(leaf, impl=impl)
                keys[id(key)] = (key, leaf)
                restored.append(key)
            if before.variables is not None:
                # The structure is the one split before the call: set the object's own
                # Variables (what nnx.update does, without walking the graph again).
                for variable, value in zip(before.variables, restored, strict=True):
                    variable.set_value(value)
            else:
                nnx.update(node, jax.tree.unflatten(structure, restored))
        self._keys = keys
        return result

    def _check_shared(self, nodes: dict[int, Any]) -> None:
        """Each argument is split on its own, so no two may share a variable."""
        owners: dict[int, int] = {}
        for position, node in nodes.items():
            for _, value in nnx.iter_graph(node):
                if not isinstance(value, nnx.Variable):
                    continue
                owner = owners.setdefault(id(value), position)
                if owner != position:
                    raise ZKDVError(
                        _messages.NNX_SHARED.format(
                            first=self._names[owner], second=self._names[position]
                        )
                    )

    def _discover(self, values: list[Any], nodes: dict[int, Any]) -> None:
        """Find the parameter leaves of donated NNX arguments (one abstract trace).

        ``proof.jit`` donates only parameters (optimizer state stays for a sampled
        check), and which leaves are parameters is known only once
        ``optimizer.update`` has run.
        """
        donated = [i for i in nodes if i in self._donate]
        if not donated:
            return
        # jax.eval_shape traces the step without running it; the parameters found are
        # mapped back to the arguments' leaves by position.
        flat, structure = jax.tree.flatten(values)
        positions: dict[int, int] = {}
        found: set[int] = set()

        def staged(*leaves: Any) -> None:
            positions.update((id(leaf), index) for index, leaf in enumerate(leaves))
            found.update(self._parameters(jax.tree.unflatten(structure, list(leaves))))

        jax.eval_shape(staged, *flat)
        params = {positions[i] for i in found if i in positions}
        start = 0
        for position, value in enumerate(values):
            size = len(jax.tree.leaves(value))
            if position in donated:
                assert isinstance(value, Graph)
                value.donatable = [flat[k] for k in range(start, start + size) if k in params]
            start += size

    def _parameters(self, values: list[Any]) -> set[int]:
        """Trace the step on ``values`` without a proof context; ids of the parameters."""
        objects = {i: v.merge() for i, v in enumerate(values) if isinstance(v, Graph)}
        found: list[_Update] = []
        call = [objects.get(i, v) for i, v in enumerate(values)]
        with _intercepted(list(objects.values()), found):
            self._signature.call(call)
        if not found:
            raise ZKDVError(_messages.NNX_NO_UPDATE)
        return {id(leaf) for leaf in jax.tree.leaves(found[0].params)}

    # -- staged side ------------------------------------------------------------------
    def _pure(self) -> Callable[..., Any]:
        function = self._function
        signature = self._signature
        names = self._names

        @functools.wraps(function)
        def pure(*args: Any, **kwargs: Any) -> Any:
            values = list(signature.bind(*args, **kwargs))
            graphs = {i: v for i, v in enumerate(values) if isinstance(v, Graph)}
            objects = {i: graph.merge() for i, graph in graphs.items()}
            found: list[_Update] = []
            with _intercepted(list(objects.values()), found):
                result = signature.call([objects.get(i, v) for i, v in enumerate(values)])
            if any(is_graph_node(leaf) for leaf in jax.tree.leaves(result, is_leaf=is_graph_node)):
                raise ZKDVError(_messages.NNX_RETURNED_OBJECT)
            after = {i: _split(obj) for i, obj in objects.items()}
            for i, graph in after.items():
                if graph.graphdef != graphs[i].graphdef:
                    raise ZKDVError(_messages.NNX_STRUCTURE_CHANGED.format(name=names[i]))
            states = [after[i] for i in graphs]
            context = _context.current()
            if context is None:
                return result, states
            if not found:
                raise ZKDVError(_messages.NNX_NO_UPDATE)
            update = found[0]
            params_before = update.params
            ids = {id(leaf) for leaf in jax.tree.leaves(params_before)}
            # The arguments that hold the parameters or the optimizer are the training
            # state; their leaves other than the parameters are the continuity tree.
            holders = [
                i
                for i, graph in graphs.items()
                if any(id(leaf) in ids for leaf in jax.tree.leaves(graph))
                or any(node is update.optimizer for _, node in nnx.iter_graph(objects[i]))
            ]
            if not any(
                any(id(leaf) in ids for leaf in jax.tree.leaves(graphs[i])) for i in holders
            ):
                raise ZKDVError(_messages.NNX_MODEL_NOT_AN_INPUT)
            # Each leaf of the state arguments before the step, and the same leaf after.
            successor = {
                id(leaf): new
                for i in holders
                for leaf, new in zip(
                    jax.tree.leaves(graphs[i]), jax.tree.leaves(after[i]), strict=True
                )
            }
            if any(id(leaf) not in successor for leaf in jax.tree.leaves(params_before)):
                raise ZKDVError(_messages.NNX_MODEL_NOT_AN_INPUT)
            params_after = jax.tree.map(lambda leaf: successor[id(leaf)], params_before)
            opt_before = {
                names[i]: _filtered(
                    nnx.to_pure_dict(graphs[i].state), lambda leaf: id(leaf) not in ids
                )
                for i in holders
            }
            opt_after = jax.tree.map(lambda leaf: successor[id(leaf)], opt_before)
            deltas = jax.tree.map(_delta, params_before, params_after)
            if context.mode == "replay":
                raise _context.Boundary((deltas, params_after, opt_after))
            context.open(
                _context.Registration(
                    "nnx",
                    params_before,
                    opt_before,
                    None,
                    None,
                    deltas=deltas,
                    params_after=params_after,
                    opt_after=opt_after,
                    completed=True,
                    recorded=update.recorded,
                    counters=() if update.step is None else (update.step,),
                )
            )
            return result, states

        return pure
