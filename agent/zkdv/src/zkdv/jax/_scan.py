"""``zkdv.jax.scan``: several training updates per compiled call, each its own step.

A TPU-style training loop runs several updates per compiled call::

    @proof.jit(donate_argnums=(0,))
    def train_steps(state, batches):  # batches: (K, batch, ...)
        def body(state, batch):
            grads = jax.grad(loss)(state.params, batch)
            return state.apply_gradients(grads=grads), None

        state, _ = zkdv.jax.scan(body, state, batches)
        return state

The protocol is one step record per update (``shared/DESIGN.md`` section 4), so every
update inside the scan is a committed step with its own batch, and the attested
``transition`` is *one* update, which the SDK's checks and the platform's replay apply
step by step as for any run. How:

1. The body is traced once to a jaxpr (``jax.make_jaxpr``) under an *iteration*
   context, where ``apply_gradients`` registers its update: the state's leaves must be
   carry leaves and the body must return the updated state in the same place of its
   carry. Values the body closes over that the step computed (JAX tracers of the
   step's trace: a learning rate, a PRNG key, a teacher's output) are the jaxpr's
   traced constants.
2. The per-update *batch* is everything one update reads besides the state: its slice
   of ``xs``, the carry leaves that are not the state (a PRNG key carried through the
   loop, an accumulator) and the traced constants, packed with
   :class:`~zkdv.jax._tree.BatchLayout` inside the scan, one row block per update.
3. The production program is ``lax.scan`` over that jaxpr; besides the user's outputs it
   returns, stacked over the K updates, the post-update parameters and continuity
   state, the packed batches and, in a run that commits its gradients
   (:mod:`zkdv.jax._optimizer`), each update's computed values (its gradient and
   carried values); otherwise the deltas. The driver submits K steps per call.
4. In a run that commits its gradients the body's update is the canonical apply
   program of its computed values (the traced body's Optax update is dead code), and
   the artifact (version 2) holds one update's gradient program and that apply
   program, which the checks and the replay run step by step as for a plain step.
   Otherwise (a state with ``attest_apply_fn``) it holds the transition (``(params,
   opt_state, batch) -> (deltas, params_after, opt_state_after)``). Both evaluate the
   same jaxpr for one update: the carry is rebuilt from the state and the batch's carry
   leaves, the traced constants from the batch.

Outside a ``proof.jit`` trace (``jax.jit``, eager) ``zkdv.jax.scan`` is ``jax.lax.scan``;
a scan whose body declares no update (gradient accumulation over microbatches, the
update after it) is one too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from zkdv.compilation import jax_trees
from zkdv.driver.flowcontrol import Admission
from zkdv.errors import ZKDVError
from zkdv.jax import _context, _messages, _optimizer
from zkdv.jax._export import one_update_material, state_shardings
from zkdv.jax._program import _Program, _Traced
from zkdv.jax._steps import _Step
from zkdv.jax.artifact import Artifact

if TYPE_CHECKING:
    from zkdv.driver import Runtime
    from zkdv.jax._driver import ZKDV
from zkdv.jax._tree import BatchLayout, leaf_paths
from zkdv.overlap import Policy
from zkdv.transaction import bind_input

__all__ = ["ScanUpdates", "scan"]


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` whose body may update the training state: one step per update.

    Same arguments and result as :func:`jax.lax.scan`. Inside a ``proof.jit`` step, a
    body that calls ``apply_gradients()`` on a ``zkdv.jax.contrib.TrainState`` carried
    through the scan makes every iteration a committed transcript step, with its own
    batch: its slice of ``xs``, the carry leaves that are not the state and the step
    values the body closes over. The state passed in must be the step's input state.
    Anywhere else (and for a body without an update) it is ``jax.lax.scan``.

    Raises:
        ZKDVError: the body updates a state that is not its carry, does not return the
            updated state in its carry, updates twice, or declares the update with
            another API; in a multi-process run.
    """
    options: dict[str, Any] = {
        "length": length,
        "reverse": reverse,
        "unroll": unroll,
        "_split_transpose": _split_transpose,
    }
    context = _context.current()
    if context is None or context.mode != "production" or context.nested():
        return lax.scan(f, init, xs, **options)
    x_example = None if xs is None else jax.tree.map(_slice_spec, xs)
    # A run that commits its gradients (the step's capture): each update's too.
    capture = context.capture
    trace = _trace_body(context.proof, f, init, x_example, commits=capture is not None)
    if trace.update is None:
        # No update inside (gradient accumulation over microbatches): a plain scan of
        # the traced body.
        def plain(carry: Any, x: Any) -> tuple[Any, Any]:
            outputs = trace.call(carry, x)
            return outputs[0], outputs[1]

        return lax.scan(plain, init, xs, **options)
    if jax.process_count() > 1:
        raise ZKDVError(_messages.SCAN_MULTI_PROCESS.format(count=jax.process_count()))
    if context.registration is not None:
        raise ZKDVError(_messages.SCAN_TWICE)
    update = trace.update
    replay = _replay_trace(context.proof, f, init, x_example, trace)
    replay_update = replay.update
    assert replay_update is not None
    init_leaves = jax.tree.leaves(init)
    layout, hoisted = _batch_layout(xs, init_leaves, update, replay)
    zero = None if capture is None else capture.zero
    body = _committing_body(trace, update, layout, hoisted, zero)
    final, (ys, hidden, packed) = lax.scan(body, init, xs, **options)
    deltas, params_stacked, opt_stacked, computed_stacked = hidden
    # A gradient-committing loop stacks each update's input state (_committing_body): the
    # last update's post-state is the loop's result, returned again as outputs of the
    # call's own (the returned state is the caller's, donated to the next call).
    positions = () if update.spec is None else (*update.param_positions, *update.opt_positions)
    final_leaves = jax.tree.leaves(final)
    last = [final_leaves[i] for i in positions]
    count = int(packed.shape[0])
    updates = ScanUpdates(
        count=count,
        reverse=bool(reverse),
        per_loop=count if unroll is True else max(1, min(int(unroll), count)),
        layout=layout,
        packed=packed,
        stacked=[*params_stacked, *opt_stacked, *computed_stacked, *last],
        counts=(len(update.param_positions), len(update.opt_positions)),
        transition=None if update.spec else _transition(replay, replay_update, layout),
        spec=update.spec,
        gradient_program=None if update.spec is None else _one_update(trace, update, layout),
        jaxpr=trace.closed,
    )
    context.open(_registration(update, init_leaves, final, deltas, updates))
    return final, ys


def _batch_layout(
    xs: Any, init_leaves: list[Any], update: _Update, replay: _Trace
) -> tuple[BatchLayout, list[Any]]:
    """The per-update batch's layout, and the traced constants it carries.

    One update's batch is its slice of ``xs``, the carry leaves that are not the state
    and the body's traced (step-computed) constants, in that order.
    """
    # Arrays with the types the loop sees (a Python scalar in the carry is a weak array).
    x_leaves = [] if xs is None else [jnp.asarray(x)[0] for x in jax.tree.leaves(xs)]
    carried = [jnp.asarray(init_leaves[i]) for i in update.other_positions]
    hoisted = [replay.closed.consts[i] for i in replay.hoisted]
    paths = (
        ([] if xs is None else leaf_paths(xs, "xs"))
        + [update.carry_paths[i] for i in update.other_positions]
        + [f"closure[{i}]" for i in range(len(hoisted))]
    )
    return BatchLayout.of(paths, [*x_leaves, *carried, *hoisted]), hoisted


def _committing_body(
    trace: _Trace,
    update: _Update,
    layout: BatchLayout,
    hoisted: list[Any],
    zero: Any,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """The production scan's body: the traced body, and each update's packed batch.

    In a run that commits its gradients (``update.spec``; ``zero``, the step's runtime
    zero) the body's state update is the canonical one of the update's computed values,
    which it returns stacked in place of the deltas; the traced body's own Optax update
    is dead code that XLA removes.
    """
    apply = None
    if update.spec is not None:
        function, _ = _optimizer.apply_function(update.spec)
        apply = functools.partial(_canonical_update, function, zero)

    def body(carry: Any, x: Any) -> tuple[Any, Any]:
        carry_out, y, hidden = trace.call(carry, x)
        carry_leaves = jax.tree.leaves(carry)
        deltas: list[Any] = []
        computed: list[Any] = []
        if apply is None:
            deltas, params_after, opt_after = hidden
            stacked_params, stacked_opt = params_after, opt_after
        else:
            computed = list(hidden)
            carry_out, _, _ = apply(trace, update, carry_leaves, carry_out, computed)
            # The state the update read, not the one it wrote: stacking the canonical
            # update's results beside the carry made XLA compute its fenced chains twice
            # (28.6 ms a call against 7.5 to 9.3 with the inputs stacked). Update j's
            # post-state is update j + 1's input; the last one's is the loop's result.
            stacked_params = tuple(carry_leaves[i] for i in update.param_positions)
            stacked_opt = tuple(carry_leaves[i] for i in update.opt_positions)
        packed = layout.pack(
            [
                *([] if x is None else jax.tree.leaves(x)),
                *(carry_leaves[i] for i in update.other_positions),
                *hoisted,
            ]
        )
        return carry_out, (y, (deltas, stacked_params, stacked_opt, computed), packed)

    return body


def _canonical_update(
    function: Callable[..., tuple[Any, Any]],
    zero: Any,
    trace: _Trace,
    update: _Update,
    carry_leaves: list[Any],
    carry_out: Any,
    computed: list[Any],
) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """One update's state as the committed apply program computes it from its computed
    values (``zero``: the step's runtime zero), and the carry with it in the state's
    place."""
    params = tuple(carry_leaves[i] for i in update.param_positions)
    opt = tuple(carry_leaves[i] for i in update.opt_positions)
    params_after, opt_after = function(params, opt, tuple(computed), zero)
    out = jax.tree.leaves(carry_out)
    for positions, values in (
        (update.param_positions, params_after),
        (update.opt_positions, opt_after),
    ):
        for position, value in zip(positions, values, strict=True):
            out[position] = value
    carry = jax.tree.unflatten(trace.carry_tree, out)
    return carry, params_after, opt_after


def _registration(
    update: _Update, init_leaves: list[Any], final: Any, deltas: Any, updates: ScanUpdates
) -> _context.Registration:
    """The step's registration of the scan's updates: the state before and after them."""
    final_leaves = jax.tree.leaves(final)
    if updates.spec is not None:
        # No deltas stacked: the commit stage forms each update's delta probes from its
        # probed rows (_Step._row_probes), as for a plain step committed on the host.
        # The final parameters stand in for the deltas the registration's schema holds.
        deltas = [final_leaves[i] for i in update.param_positions]
    return _context.Registration(
        "train_state",
        jax.tree.unflatten(update.param_tree, [init_leaves[i] for i in update.param_positions]),
        jax.tree.unflatten(update.opt_tree, [init_leaves[i] for i in update.opt_positions]),
        None,
        None,
        deltas=jax.tree.unflatten(update.param_tree, list(deltas)),
        params_after=jax.tree.unflatten(
            update.param_tree, [final_leaves[i] for i in update.param_positions]
        ),
        opt_after=jax.tree.unflatten(
            update.opt_tree, [final_leaves[i] for i in update.opt_positions]
        ),
        completed=True,
        scan=updates,
    )


def _slice_spec(x: Any) -> Any:
    shape = jnp.shape(x)
    if not shape:
        raise ValueError("zkdv.jax.scan: every leaf of xs needs a leading axis to scan over")
    return jax.ShapeDtypeStruct(shape[1:], x.dtype)  # type: ignore[no-untyped-call]


@dataclass
class _Update:
    """Where the update of one traced iteration sits in the body's inputs and outputs."""

    param_positions: tuple[int, ...]
    opt_positions: tuple[int, ...]
    other_positions: tuple[int, ...]
    param_tree: Any
    opt_tree: Any
    carry_paths: list[str]
    #: In a run that commits its gradients: the update the body declared; the traced
    #: body's hidden outputs are then its computed values.
    spec: _optimizer.UpdateSpec | None = None


@dataclass
class _Trace:
    """The body traced once: ``(carry, x) -> (carry, y, (deltas, params, opt_state))``."""

    closed: Any
    carry_tree: Any
    y_tree: Any
    update: _Update | None
    hoisted: tuple[int, ...]  # indices of the jaxpr's traced (step-computed) constants

    def call(self, carry: Any, x: Any, consts: Sequence[Any] | None = None) -> Any:
        """Evaluate the traced body; returns ``(carry, y, hidden leaves)``.

        ``x`` may be any tree with the leaves of the scanned slice (the jaxpr takes flat
        leaves); ``consts`` replaces the jaxpr's constants.
        """
        closed = self.closed
        if consts is not None:
            closed = jax_core.ClosedJaxpr(closed.jaxpr, list(consts))
        leaves = [*jax.tree.leaves(carry), *jax.tree.leaves(x)]
        flat = jax_core.jaxpr_as_fun(closed)(*leaves)
        ncarry = self.carry_tree.num_leaves
        ny = self.y_tree.num_leaves
        carry_out = jax.tree.unflatten(self.carry_tree, flat[:ncarry])
        y = jax.tree.unflatten(self.y_tree, flat[ncarry : ncarry + ny])
        hidden = flat[ncarry + ny :]
        if self.update is None:
            return carry_out, y, ()
        if self.update.spec is not None:
            return carry_out, y, list(hidden)
        nparams = len(self.update.param_positions)
        return (
            carry_out,
            y,
            (hidden[:nparams], hidden[nparams : 2 * nparams], hidden[2 * nparams :]),
        )


def _trace_body(
    proof: Any, f: Callable[..., Any], init: Any, x_example: Any, *, commits: bool = False
) -> _Trace:
    """The body traced once; with ``commits`` its optimizer update is recorded, and its
    hidden outputs are the update's computed values (:func:`_optimizer.describe`)."""
    found: dict[str, Any] = {}

    def iteration(carry: Any, x: Any) -> Any:
        carry_leaves, carry_tree_ = jax.tree.flatten(carry)
        carry_tree: Any = carry_tree_
        # The capture only records here: the canonical update runs in the loop's body.
        capture = _optimizer.Capture(None) if commits else None
        inner = _context.TraceContext(proof, "scan", carry_leaves, capture=capture)
        with _context.active(inner):
            result = f(carry, x)
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise TypeError(
                "zkdv.jax.scan body must return a pair (carry, y), as jax.lax.scan's does"
            )
        carry_out, y = result
        out_leaves, out_tree = jax.tree.flatten(carry_out)
        same_structure = bool(out_tree == carry_tree)
        registration = inner.registration
        found["tree"] = carry_tree
        if registration is None:
            return carry_out, y, ()
        if registration.source != "train_state" or registration.scan is not None:
            raise ZKDVError(_messages.SCAN_NOT_TRAIN_STATE)
        try:
            params = bind_input(carry_leaves, registration.params_before, "params", jax_trees())
            opt = bind_input(carry_leaves, registration.opt_before, "opt_state", jax_trees())
        except ValueError:
            raise ZKDVError(_messages.SCAN_STATE_NOT_CARRY) from None
        if not same_structure:
            raise ZKDVError(_messages.SCAN_STATE_NOT_RETURNED)
        for positions, value in (
            (params.leaves, registration.params_after),
            (opt.leaves, registration.opt_after),
        ):
            after = jax.tree.leaves(value)
            if any(out_leaves[i] is not leaf for i, leaf in zip(positions, after, strict=True)):
                raise ZKDVError(_messages.SCAN_STATE_NOT_RETURNED)
        state = set(params.leaves) | set(opt.leaves)
        found["update"] = _Update(
            param_positions=params.leaves,
            opt_positions=opt.leaves,
            other_positions=tuple(i for i in range(len(carry_leaves)) if i not in state),
            param_tree=jax.tree.structure(registration.params_before),
            opt_tree=jax.tree.structure(registration.opt_before),
            carry_paths=leaf_paths(carry, "carry"),
        )
        if registration.recorded is not None:
            spec, computed = _optimizer.describe(
                registration.recorded,
                jax.tree.leaves(registration.params_before),
                jax.tree.leaves(registration.params_after),
                jax.tree.leaves(registration.opt_before),
                jax.tree.leaves(registration.opt_after),
                counters=registration.counters,
                overwrite=registration.overwrite,
            )
            found["update"].spec = spec
            return carry_out, y, computed
        hidden = (
            jax.tree.leaves(registration.deltas),
            jax.tree.leaves(registration.params_after),
            jax.tree.leaves(registration.opt_after),
        )
        return carry_out, y, hidden

    closed, shapes = jax.make_jaxpr(iteration, return_shape=True)(init, x_example)
    _, y_shape, _ = shapes
    hoisted = tuple(i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer))
    return _Trace(
        closed=closed,
        carry_tree=found["tree"],
        y_tree=jax.tree.structure(y_shape),
        update=found.get("update"),
        hoisted=hoisted,
    )


def _replay_trace(
    proof: Any, f: Callable[..., Any], init: Any, x_example: Any, production: _Trace
) -> _Trace:
    """The body as sampled replays run it: ``attest_apply_fn`` in place of ``apply_fn``."""
    from zkdv.jax.contrib import TrainState

    def substitute(node: Any) -> Any:
        if isinstance(node, TrainState) and node.attest_apply_fn is not None:
            return node.replace(apply_fn=node.attest_apply_fn)
        return node

    def is_state(node: Any) -> bool:
        return isinstance(node, TrainState)

    states = [node for node in jax.tree.leaves(init, is_leaf=is_state) if is_state(node)]
    if not any(state.attest_apply_fn is not None for state in states):
        return production
    replay = _trace_body(proof, f, jax.tree.map(substitute, init, is_leaf=is_state), x_example)
    if replay.update is None:
        raise ZKDVError("zkdv.jax.scan: the body with attest_apply_fn declared no update")
    return replay


def _one_iteration(
    trace: _Trace,
    update: _Update,
    params: Sequence[Any],
    opt_state: Sequence[Any],
    values: Sequence[Any],
) -> Any:
    """The traced body on one update's state and unpacked batch ``values``: the carry is
    rebuilt from the state and the batch's carry leaves, the traced constants from the
    batch. Returns the body's hidden outputs."""
    nother = len(update.other_positions)
    nx = len(values) - nother - len(trace.hoisted)
    x_leaves, rest = list(values[:nx]), list(values[nx:])
    carry: list[Any] = [None] * trace.carry_tree.num_leaves
    for positions, leaves in (
        (update.param_positions, params),
        (update.opt_positions, opt_state),
        (update.other_positions, rest[:nother]),
    ):
        for position, leaf in zip(positions, leaves, strict=True):
            carry[position] = leaf
    filled = list(trace.closed.consts)
    for index, value in zip(trace.hoisted, rest[nother:], strict=True):
        filled[index] = value
    _, _, hidden = trace.call(jax.tree.unflatten(trace.carry_tree, carry), x_leaves, filled)
    return hidden


def _transition(replay: _Trace, update: _Update, layout: BatchLayout) -> Callable[..., Any]:
    """One update of the scan as a state transition over flat leaves (the artifact's)."""

    def transition(
        params: tuple[Any, ...], opt_state: tuple[Any, ...], batch: Any
    ) -> tuple[Any, Any, Any]:
        hidden = _one_iteration(replay, update, params, opt_state, layout.unpack(batch))
        deltas, params_after, opt_after = hidden
        return tuple(deltas), tuple(params_after), tuple(opt_after)

    return transition


def _one_update(trace: _Trace, update: _Update, layout: BatchLayout) -> Callable[..., Any]:
    """One update's gradient program, as the version-2 artifact's ``production``.

    ``((), (params..., opt_state..., batch inputs...), zero) -> (packed batch, computed
    values...)``: the body on one update's state and unpacked batch, up to its computed
    values (the update after them is dead code), in the artifact's input layout (nothing
    donated; ``ScanUpdates.commit_programs``).
    """
    nparams, nopt = len(update.param_positions), len(update.opt_positions)

    def production(donated: tuple[Any, ...], kept: tuple[Any, ...], zero: Any) -> Any:
        del donated, zero  # the canonical update is the apply program's
        values = kept[nparams + nopt :]
        computed = _one_iteration(
            trace, update, kept[:nparams], kept[nparams : nparams + nopt], values
        )
        return (layout.pack(list(values)), *computed)

    return production


@dataclass
class ScanUpdates:
    """The K updates of one ``zkdv.jax.scan``, as the production trace declared them.

    Attributes:
        count: updates per call (the scan's length).
        reverse: the scan ran backwards (update j's outputs are in row K - 1 - j).
        per_loop: updates in one iteration of the compiled loop (``unroll``).
        layout: the packed per-update batch.
        packed: the stacked packed batches, ``(K, rows, cols)`` uint32.
        stacked: stacked parameter leaves, then continuity leaves: each update's
            post-update state, or in a run that commits its gradients its *input* state,
            followed by the stacked computed values and the last update's post-update
            parameter and continuity leaves (:meth:`post_row`).
        counts: number of parameter and continuity leaves.
        transition: one update as ``(params, opt_state, batch) -> (deltas, params_after,
            opt_state_after)`` over flat leaves, in a run that commits no gradients.
        spec: the update whose computed values each step commits (None: the run commits
            no gradients, version-1 artifact).
        gradient_program: with ``spec``, one update's gradient program
            (the artifact's ``production``).
        jaxpr: the traced body, closed (its precision is the root's ``env.precision``).
        names: the computed values' names, once :meth:`commit_programs` ran.
    """

    count: int
    reverse: bool
    per_loop: int
    layout: BatchLayout
    packed: Any
    stacked: list[Any]
    counts: tuple[int, int]
    transition: Callable[..., Any] | None
    spec: _optimizer.UpdateSpec | None = None
    gradient_program: Callable[..., Any] | None = None
    jaxpr: Any = None
    names: tuple[str, ...] = ()

    @property
    def extra(self) -> list[Any]:
        """The production program's extra outputs: packed batches, then stacked state."""
        return [self.packed, *self.stacked]

    def row(self, j: int) -> int:
        return self.count - 1 - j if self.reverse else j

    @property
    def stacks_inputs(self) -> bool:  # each update's input state: a gradient-committing run
        return self.spec is not None

    def post_row(self, j: int) -> int | None:
        """The stacked row holding update j's post-update state; None for the last
        update of a run that stacks inputs, whose post-state is the call's own copy."""
        if not self.stacks_inputs:
            return self.row(j)
        return self.row(j + 1) if j + 1 < self.count else None

    def pre_row(self, j: int) -> int:
        """The stacked row holding update j's input state (j > 0 without inputs)."""
        return self.row(j) if self.stacks_inputs else self.row(j - 1)

    def commit_programs(
        self, runtime: Runtime, traced: _Traced, params: list[Any], opt: list[Any]
    ) -> Artifact:
        """Export, commit and load the programs of a scan whose updates commit gradients.

        A version-2 artifact over *one* update (``docs/jax.md``, section 3.2): its
        ``production`` is :func:`_one_update` on the unpacked batch, its ``apply`` the
        canonical update the loop's body runs; the checks and the platform's replay
        run them step by step. The training itself runs the scan.
        """
        assert self.spec is not None and self.gradient_program is not None
        # The traced body's last outputs are the computed values (_trace_body).
        outputs = self.jaxpr.out_avals
        computed = outputs[len(outputs) - len(self.spec.weak[2]) :]
        material, self.names, env, bounds = one_update_material(
            traced, self.spec, self.gradient_program, computed, self.jaxpr, (params, opt)
        )
        runtime.set_program(
            "jax.export", material, env=env, bounds=bounds, shardings=state_shardings(params, opt)
        )
        return Artifact.loads(material)

    def submit(
        self,
        proof: ZKDV,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        host_pre: Any,
        snapshot: Any,
        admission: Any,
    ) -> None:
        """Submit the call's K updates as steps ``index .. index + K - 1``.

        The call holds one admission (one generation of device buffers): it retires
        with the last of its steps; the others register nothing.
        """
        schema = program.traced.schema
        nparams, nopt = self.counts
        # A run that commits its gradients stacks no deltas (scan()).
        deltas = [] if self.spec is not None else list(outputs[: program.traced.delta_leaves])
        extra = list(outputs[schema.hidden_leaves : schema.hidden_leaves + schema.extra_leaves])
        packed, stacked = extra[0], extra[1:]
        last = stacked[len(stacked) - (nparams + nopt) :] if self.stacks_inputs else []
        stack = _Stack(
            deltas,
            stacked[:nparams],
            stacked[nparams : nparams + nopt],
            packed,
            self.count,
            stacked[nparams + nopt : len(stacked) - len(last)],
            last,
        )
        # The call's count covers its K updates (the scan body counted ``length`` times).
        flops = None if program.flops is None else program.flops / self.count
        for j in range(self.count):
            # The pre-state of update j > 0 is in the call's stacked state (its input, or
            # update j - 1's output): a due snapshot is copied from the call's host views
            # on the commit thread.
            due = j > 0 and proof.runtime.snapshot_due(index + j)
            step = _ScanStep(
                proof,
                program,
                index + j,
                policy,
                outputs,
                host_pre if j == 0 else None,
                snapshot if j == 0 else None,
                stack,
                j,
                flops,
                self.pre_row(j) if due else None,
                self,
            )
            final = j == self.count - 1
            proof.runtime.submit(admission if final else cast(Admission, _Unregistered()), step)


class _Unregistered:
    """The admission of an update that is not the last of its call: the call's one
    admission retires with its last update."""

    def register(self, retirement: threading.Event) -> None:
        del retirement


class _Stack:
    """Host views of one call's stacked outputs, shared by its K steps.

    Read once (a D2H copy off the CPU backend), on the commit thread, when the first of
    the call's steps is committed; dropped once every step has released its views.
    """

    def __init__(
        self,
        deltas: list[Any],
        params: list[Any],
        opt: list[Any],
        packed: Any,
        count: int,
        computed: list[Any],
        last: list[Any],
    ) -> None:
        self._lock = threading.Lock()
        self._device: tuple[list[Any], ...] | None = (
            deltas,
            params,
            opt,
            [packed],
            computed,
            last,
        )
        self._host: tuple[list[np.ndarray], ...] | None = None
        self._open = count

    def views(self) -> tuple[list[np.ndarray], ...]:
        """Deltas, parameters, continuity state, ``[packed batches]``, computed values,
        and the last update's parameter and continuity leaves (:attr:`ScanUpdates.stacked`)."""
        with self._lock:
            if self._host is None:
                assert self._device is not None
                # One explicit read of the call's outputs; each step's record of the
                # transfer log counts its own rows (_Step.post_state, _Step.batch,
                # _ScanStep.computed).
                host = jax.device_get(self._device)
                self._host = tuple([np.asarray(leaf) for leaf in group] for group in host)
                self._device = None
            return self._host

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._host = None
                self._device = None


class _ScanStep(_Step):
    """One update of a ``zkdv.jax.scan`` call: its row of the call's stacked outputs."""

    def __init__(
        self,
        proof: ZKDV,
        program: _Program,
        index: int,
        policy: Policy,
        outputs: Sequence[Any],
        host_pre: Any,
        snapshot: Any,
        stack: _Stack,
        position: int,
        flops: float | None,
        snapshot_row: int | None,
        updates: ScanUpdates,
    ) -> None:
        super().__init__(proof, program, index, policy, outputs, host_pre, snapshot)
        self.flops = flops
        self._updates = updates
        self._stack = stack
        #: The update's place in its call, and its row of the stacked batches and values.
        self._position = position
        self._row = updates.row(position)
        self._snapshot_row = snapshot_row
        self._released = False
        # The base class took the stacked arrays; this step reads its row on the commit
        # thread instead.
        self._deltas = self._params = self._opt = []
        self._packed = None

    # The driver reads the snapshot on the commit thread, before the step's commitment
    # and so before any check that replays from it.
    @property
    def snapshot(self) -> Any:
        row = self._snapshot_row
        if row is not None:
            self._snapshot_row = None
            _, params, opt, *_ = self._stack.views()
            copied = (
                [np.array(leaf[row]) for leaf in params],
                [np.array(leaf[row]) for leaf in opt],
            )
            with self.proof._store_lock:
                self.proof._snapshots[self.index] = copied
            nbytes = sum(a.nbytes for tree in copied for a in tree)
            self.proof._log.add(self.index, "snapshot", nbytes)
            self._snapshot_source = copied
        return _Step.snapshot.fget(self)  # type: ignore[attr-defined]

    @snapshot.setter
    def snapshot(self, value: Any) -> None:
        _Step.snapshot.fset(self, value)  # type: ignore[attr-defined]

    def batch(self) -> np.ndarray:
        if self._batch is None:
            packed = self._stack.views()[3][0]
            # A copy: the batch is kept for replays after the call's views are dropped.
            self._packed = np.array(packed[self._row])
        batch: np.ndarray = super().batch()
        return batch

    def computed(self) -> Any:
        """The update's computed values, its row of the call's stacked ones."""
        spec = self._updates.spec
        if spec is None:
            return None
        rows = [leaf[self._row] for leaf in self._stack.views()[4]]
        return self._read_computed(spec, self._updates.names, rows)

    def post_state(self) -> Any:
        deltas, params, opt, _, _, last = self._stack.views()
        updates = self._updates
        row = updates.post_row(self._position)
        # None: the delta probes are of the probed rows (_Step._row_probes).
        self._deltas = None if updates.spec is not None else [leaf[self._row] for leaf in deltas]
        if row is None:  # the call's last update: its post-state is the call's own copy
            self._params, self._opt = last[: len(params)], last[len(params) :]
        else:
            self._params = [leaf[row] for leaf in params]
            self._opt = [leaf[row] for leaf in opt]
        return super().post_state()

    def release_views(self) -> None:
        super().release_views()
        if not self._released:
            self._released = True
            self._stack.release()
