"""The jaxpr interpreter of ``zkdv-jax-canonical-v2`` and its rule for each primitive.

:class:`_Evaluator` runs a jaxpr equation by equation over the fenced arithmetic of
:mod:`zkdv.jax._canonical_arithmetic`: exact operations as XLA does them, each float
operation by its rule below (control flow evaluated with these rules inside), and every
other primitive raises :class:`~zkdv.jax.canonical.NotCanonical` with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from zkdv.jax._canonical_arithmetic import (
    _F64,
    _FORMATS,
    CANONICAL_VERSION,
    ISOLATED,
    NotCanonical,
    _Arithmetic,
    _is_float,
)
from zkdv.jax._canonical_sums import exact_sum32, exact_sum64

_Rule = Callable[["_Evaluator", Any, list[Any]], list[Any]]


class _Slice(NamedTuple):
    """Row ``row`` of ``stack``: a result of :meth:`_Evaluator.stacked`."""

    stack: Any
    row: int


class _Evaluator(_Arithmetic):
    """The jaxpr interpreter over fenced arithmetic."""

    def run_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        consts = [self.fence(jnp.asarray(c)) for c in closed.consts]
        return self.run(closed.jaxpr, consts, args)

    def run_any(self, jaxpr: Any, args: Sequence[Any]) -> list[Any]:
        if isinstance(jaxpr, core.ClosedJaxpr):
            return self.run_closed(jaxpr, args)
        return self.run(jaxpr, [], args)

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        materialized: dict[int, Any] = {}

        def value(item: Any) -> Any:
            if not isinstance(item, _Slice):
                return item
            # A stack leaves the region where the equations stacked on it fuse: XLA
            # would otherwise fuse the rules' program into each slice's consumer, once
            # per leaf again.
            whole = materialized.get(id(item.stack))
            if whole is None:
                whole = materialized[id(item.stack)] = self.isolated(lambda x: x, item.stack)
            return lax.index_in_dim(whole, item.row, 0, keepdims=False)

        def read(var: Any) -> Any:
            if isinstance(var, core.Literal):
                aval: Any = var.aval
                return _fence_constant(np.asarray(var.val, dtype=aval.dtype))
            return env[var]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for group in _schedule(jaxpr.eqns):
            if len(group) == 1:
                args_ = [value(read(v)) for v in group[0].invars]
                results = [self.equation(group[0], args_)]
            else:
                results = self.stacked(group, [[read(v) for v in e.invars] for e in group], value)
            for eqn, outputs in zip(group, results, strict=True):
                for var, result in zip(eqn.outvars, outputs, strict=True):
                    if not isinstance(var, core.DropVar):
                        env[var] = result
        return [value(read(v)) for v in jaxpr.outvars]

    def stacked(
        self, group: Sequence[Any], args: Sequence[list[Any]], value: Callable[[Any], Any]
    ) -> list[list[Any]]:
        """One elementwise equation applied to several arrays of one shape, as one
        operation on their stack (``_schedule``'s groups): elementwise, so each element's
        bits are those of the equation applied alone, and the long rule is in the
        program once for the group, not once per leaf. The results are slices of the
        stack (:class:`_Slice`), which the next stacked equation takes whole."""
        eqn = group[0]
        if eqn.primitive.name in _REDUCTIONS:  # the same axes of each row of the stack
            (rows,) = zip(*args, strict=True)
            shape = (len(group), *eqn.invars[0].aval.shape)
            whole = _whole(rows, shape)
            stack = jnp.stack([value(o) for o in rows]) if whole is None else whole
            axes = tuple(axis + 1 for axis in eqn.params["axes"])
            (total,) = self.equation(eqn.replace(params={**eqn.params, "axes": axes}), [stack])
            return [[_Slice(total, index)] for index in range(len(group))]
        shape = (len(group), *eqn.outvars[0].aval.shape)
        inputs = []
        for position, operands in enumerate(zip(*args, strict=True)):
            first, whole = operands[0], _whole(operands, shape)
            if len({id(e.invars[position]) for e in group}) == 1:
                inputs.append(value(first))  # one value (a literal, a shared scalar)
            elif whole is not None:
                inputs.append(whole)  # the stack an earlier group made
            elif eqn.invars[position].aval.shape == ():  # a scalar of each: broadcast them
                scalars = jnp.stack([value(o) for o in operands])
                scalars = scalars.reshape((len(group),) + (1,) * (len(shape) - 1))
                inputs.append(jnp.broadcast_to(scalars, shape))
            else:
                inputs.append(jnp.stack([value(o) for o in operands]))
        outputs = self.equation(eqn, inputs)
        return [[_Slice(out, index) for out in outputs] for index in range(len(group))]

    def equation(self, eqn: Any, args: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        dtypes = [getattr(v.aval, "dtype", None) for v in (*eqn.invars, *eqn.outvars)]
        if any(d is None or jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
            raise NotCanonical(
                f"{CANONICAL_VERSION} has no rule for the JAX primitive '{name}' on "
                f"{', '.join(str(d) for d in dtypes)}: only real and integer arrays are"
                " canonical"
            )
        nested = any(True for _ in core.jaxprs_in_params(eqn.params))
        if name in _EXACT or not (nested or any(_is_float(d) for d in dtypes)):
            # Exact on every backend: data movement, comparisons, integer arithmetic. Their
            # float results are (flushed) operands, except for conversions.
            if name == "bitcast_convert_type":
                args = [self.seal(a) for a in args]
            if name in _CONVERSIONS:
                return [self.fence(y) for y in _bind(eqn, args)]
            return _bind(eqn, args)
        rule = _RULES.get(name)
        if rule is not None and name not in _SHORT and _small(eqn):
            return list(self.isolated(lambda *a: rule(self, eqn, list(a)), *args))
        if rule is not None:
            return rule(self, eqn, args)
        reason = _REASONS.get(name, "no canonical rule is defined for it")
        raise NotCanonical(
            f"{CANONICAL_VERSION} cannot evaluate the JAX primitive '{name}' on floats: "
            f"{reason}. Run this computation outside the canonical region."
        )


def _whole(operands: Sequence[Any], shape: tuple[int, ...]) -> Any:
    """The stack whose rows, in order, ``operands`` are (:class:`_Slice`), or None."""
    first = operands[0]
    if not isinstance(first, _Slice) or first.stack.shape != shape:
        return None
    if all(
        isinstance(o, _Slice) and o.stack is first.stack and o.row == i
        for i, o in enumerate(operands)
    ):
        return first.stack
    return None


def _schedule(eqns: Sequence[Any]) -> list[list[Any]]:
    """The equations in an order that keeps each after its inputs, with the elementwise
    ones that share a rule, its parameters and one shape, and depend on nothing among
    themselves, gathered into groups (:meth:`_Evaluator.stacked`).

    An optimizer applies the same formula to every leaf, so a model of many leaves of a
    few shapes (a transformer's blocks) repeats each long rule once per leaf; XLA then
    compiles each copy (a TPU v5e: 1.5 to 2.7 s a leaf). Grouped, the program holds each rule
    once per shape. Equations are taken level by level (a level: one more than the
    deepest of its inputs' equations), so the same step of every leaf's formula lands in
    one level. A jaxpr with effects keeps its order.
    """
    if any(eqn.effects for eqn in eqns):
        return [[eqn] for eqn in eqns]
    depth: dict[Any, int] = {}
    levels: dict[int, list[Any]] = {}
    for eqn in eqns:
        level = 1 + max(
            (depth.get(v, 0) for v in eqn.invars if not isinstance(v, core.Literal)), default=0
        )
        for var in eqn.outvars:
            depth[var] = level
        levels.setdefault(level, []).append(eqn)
    order: list[list[Any]] = []
    for level in sorted(levels):
        groups: dict[Any, list[Any]] = {}
        for eqn in levels[level]:
            key = _stack_key(eqn)
            if key is None:
                order.append([eqn])
            elif key in groups:
                groups[key].append(eqn)
            else:
                groups[key] = [eqn]
                order.append(groups[key])
    return order


# Reductions: stacked, each row reduced over the same axes (exact, so in any order).
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})

#: The largest leaf (elements) that is stacked; 0: none, each leaf has its own copy of
#: each rule (the bits are the same either way). Stacking trades copies at every step
#: (in proportion to the bytes) for a shorter compile once (in proportion to the
#: leaves): a transformer's small leaves (biases, norms) are most of its leaves and few
#: of its bytes. ``bench/tpu_overhead.py --compare-stack-limits`` weighs the two, setting
#: it through :func:`zkdv.jax.canonical.stack_limit`.
STACK_LIMIT = 1 << 16

# Elementwise rules: stacked, each is in the program once per shape, not once per leaf.
_STACKABLE = frozenset(
    {"div", "sqrt", "rsqrt", "integer_pow", "pow", "exp", "exp2", "expm1", "log", "log1p",
     "sin", "cos", "tan", "tanh", "logistic", "sinh", "cosh", "add", "add_any", "sub",
     "mul", "max", "min", "square"}
)  # fmt: skip


def _stack_key(eqn: Any) -> Any:
    """What equations must share to be stacked, or None if ``eqn`` is not stackable: an
    elementwise float rule on arrays of one shape, larger than what ``ISOLATED``
    computes on its own and at most ``STACK_LIMIT``, and scalars (a literal: the same
    one); or a reduction of such an array."""
    if eqn.primitive.name in _REDUCTIONS:
        (var,) = eqn.invars
        if isinstance(var, core.Literal) or not ISOLATED < math.prod(var.aval.shape) <= STACK_LIMIT:
            return None
        return (
            eqn.primitive.name,
            repr(sorted(eqn.params.items())),
            str(var.aval.dtype),
            var.aval.shape,
        )
    if eqn.primitive.name not in _STACKABLE:
        return None
    shape = eqn.outvars[0].aval.shape
    if not ISOLATED < math.prod(shape) <= STACK_LIMIT or any(
        v.aval.shape != shape for v in eqn.outvars
    ):
        return None
    operands = []
    for var in eqn.invars:
        if var.aval.shape not in ((), shape):
            return None
        literal = isinstance(var, core.Literal)
        operands.append(
            (str(var.aval.dtype), var.aval.shape == (), repr(var.val) if literal else None)
        )
    dtypes = [np.dtype(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)]
    if not any(_is_float(d) for d in dtypes):
        return None
    return eqn.primitive.name, repr(sorted(eqn.params.items())), tuple(operands), shape


def _small(eqn: Any) -> bool:
    """Every input and output of ``eqn`` has at most ``ISOLATED`` elements."""
    return all(
        math.prod(getattr(v.aval, "shape", ())) <= ISOLATED for v in (*eqn.invars, *eqn.outvars)
    )


def _fence_constant(value: np.ndarray[Any, Any]) -> Any:
    """A literal fenced and sealed here: a constant is not the result of an operation."""
    fmt = _FORMATS.get(value.dtype)
    if fmt is not None:
        bits = value.view(fmt.bits).copy()
        magnitude = bits & fmt.bits.type(fmt.magnitude)
        bits[magnitude <= fmt.min_normal] &= fmt.bits.type(fmt.sign)
        bits[magnitude > fmt.exponent] = fmt.nan
        value = bits.view(value.dtype)
    return jnp.asarray(value)


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    result = eqn.primitive.bind(*args, **eqn.params)
    return list(result) if eqn.primitive.multiple_results else [result]


def _out_dtype(eqn: Any) -> Any:
    return eqn.outvars[0].aval.dtype


# --- Rules ----------------------------------------------------------------------------


_Binary = Callable[[_Evaluator, Any, Any], Any]
_OPERATIONS: dict[str, _Binary] = {
    "add": _Evaluator.add,
    "add_any": _Evaluator.add,
    "sub": _Evaluator.sub,
    "mul": _Evaluator.mul,
    "div": _Evaluator.div,
}


def _ieee(ev: _Evaluator, operation: _Binary, a: Any, b: Any) -> Any:
    """An IEEE operation, correctly rounded to the operands' format.

    Float32 and float64 operate in their own format (float32 ``div`` from the bits).
    Narrower formats operate in float32 and round once: float32 has at least twice their
    precision plus two bits, so the double rounding is innocuous (Figueroa 1995) and the
    result is the correctly rounded one.
    """
    dtype = np.dtype(a.dtype)
    return ev.round(operation(ev, ev.wide(a), ev.wide(b)), dtype)


def _arithmetic(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    a, b = args
    return [_ieee(ev, _OPERATIONS[eqn.primitive.name], a, b)]


def _sqrt(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.round(ev.sqrt(ev.wide(args[0])), _out_dtype(eqn))]


def _cumulative(combine: Callable[[_Evaluator, Any, Any], Any]) -> _Rule:
    """``cumsum`` and friends, one element after the other along the axis."""

    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        axis, reverse = eqn.params["axis"], eqn.params["reverse"]
        x = jnp.moveaxis(args[0], axis, 0)
        if x.shape[0] <= 1:
            return [args[0]]

        def step(carry: Any, row: Any) -> tuple[Any, Any]:
            carry = combine(ev, carry, row)
            return carry, carry

        if reverse:
            _, ys = lax.scan(step, x[-1], x[:-1], reverse=True)
            result = jnp.concatenate([ys, x[-1:]])
        else:
            _, ys = lax.scan(step, x[0], x[1:])
            result = jnp.concatenate([x[:1], ys])
        return [jnp.moveaxis(result, 0, axis)]

    return rule


def _formula(formula: Callable[[_Evaluator, Any], Any]) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        return [ev.round(formula(ev, ev.wide(args[0])), _out_dtype(eqn))]

    return rule


def _rsqrt(ev: _Evaluator, x: Any) -> Any:
    return ev.div(jnp.ones_like(x), ev.sqrt(x))


def _integer_pow(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.round(ev.power_static(ev.wide(args[0]), eqn.params["y"]), _out_dtype(eqn))]


def _square(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    return [ev.round(ev.power_static(ev.wide(args[0]), 2), _out_dtype(eqn))]


def _pow(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    x, y = args
    dtype = _out_dtype(eqn)
    exponent = eqn.invars[1]
    if not _is_float(y.dtype):
        x, y = jnp.broadcast_arrays(ev.wide(x), y)
        return [ev.round(ev.power_dynamic(x, y), dtype)]
    if isinstance(exponent, core.Literal) and np.ndim(exponent.val) == 0:
        value = float(exponent.val)
        if value.is_integer() and abs(value) < 2**31:  # x ** 2.0 as written in code
            return [ev.round(ev.power_static(ev.wide(x), int(value)), dtype)]
        if abs(value) == 0.5:  # x ** 0.5, x ** -0.5: correctly rounded square roots
            wide = ev.wide(x)
            # pow(-0, y) = +0 and pow(-inf, y) = +inf for y = 0.5 (C99), unlike sqrt.
            wide = jnp.where((wide == 0.0) | (wide == -jnp.inf), jnp.abs(wide), wide)
            root = ev.sqrt(wide)
            return [ev.round(root if value > 0 else ev.div(jnp.ones_like(root), root), dtype)]
    x, y = jnp.broadcast_arrays(ev.wide(x), ev.wide(y))
    return [ev.round(ev.power(x, y), dtype)]


def _maximum(largest: bool) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        a, b = args
        return [ev.maximum(a, b, largest=largest)]

    return rule


def _clamp(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    low, x, high = args
    return [ev.maximum(ev.maximum(x, low, largest=True), high, largest=False)]


def _reduce_extreme(largest: bool) -> _Rule:
    def rule(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
        return [ev.extreme(args[0], tuple(eqn.params["axes"]), largest)]

    return rule


def _reduce_sum(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    x, axes, dtype = args[0], tuple(eqn.params["axes"]), np.dtype(_out_dtype(eqn))
    if np.dtype(x.dtype) == _F64:
        return [exact_sum64(ev, x, axes)]
    return [exact_sum32(ev, ev.wide(x), axes, dtype)]


def _inline(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return ev.run_any(eqn.params[key], args)
    raise NotCanonical(f"{CANONICAL_VERSION} found no jaxpr in '{eqn.primitive.name}'")


def _cond(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    index, *operands = args

    def branch(closed: Any) -> Callable[..., tuple[Any, ...]]:
        return lambda *xs: tuple(ev.run_closed(closed, xs))

    return list(lax.switch(index, [branch(b) for b in eqn.params["branches"]], *operands))


def _while(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    p = eqn.params
    split = p["cond_nconsts"] + p["body_nconsts"]
    cond_consts, body_consts = args[: p["cond_nconsts"]], args[p["cond_nconsts"] : split]

    def cond(carry: Any) -> Any:
        return ev.run_closed(p["cond_jaxpr"], [*cond_consts, *carry])[0]

    def body(carry: Any) -> tuple[Any, ...]:
        return tuple(ev.run_closed(p["body_jaxpr"], [*body_consts, *carry]))

    return list(lax.while_loop(cond, body, tuple(args[split:])))


def _scan(ev: _Evaluator, eqn: Any, args: list[Any]) -> list[Any]:
    p = eqn.params
    consts = args[: p["num_consts"]]
    init = tuple(args[p["num_consts"] : p["num_consts"] + p["num_carry"]])
    xs = tuple(args[p["num_consts"] + p["num_carry"] :])

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[Any, Any]:
        outputs = ev.run_closed(p["jaxpr"], [*consts, *carry, *x])
        return tuple(outputs[: p["num_carry"]]), tuple(outputs[p["num_carry"] :])

    carry, ys = lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


_RULES: dict[str, _Rule] = {
    "add": _arithmetic,
    "add_any": _arithmetic,
    "sub": _arithmetic,
    "mul": _arithmetic,
    "div": _arithmetic,
    "sqrt": _sqrt,
    "rsqrt": _formula(_rsqrt),
    "integer_pow": _integer_pow,
    "square": _square,
    "pow": _pow,
    "exp": _formula(_Evaluator.exp),
    "exp2": _formula(_Evaluator.exp2),
    "expm1": _formula(_Evaluator.expm1),
    "log": _formula(_Evaluator.log),
    "log1p": _formula(_Evaluator.log1p),
    "sin": _formula(_Evaluator.sin),
    "cos": _formula(_Evaluator.cos),
    "tan": _formula(_Evaluator.tan),
    "tanh": _formula(_Evaluator.tanh),
    "logistic": _formula(_Evaluator.logistic),
    "sinh": _formula(_Evaluator.sinh),
    "cosh": _formula(_Evaluator.cosh),
    "max": _maximum(largest=True),
    "min": _maximum(largest=False),
    "clamp": _clamp,
    "reduce_max": _reduce_extreme(largest=True),
    "reduce_min": _reduce_extreme(largest=False),
    "reduce_sum": _reduce_sum,
    "cumsum": _cumulative(lambda ev, a, b: _ieee(ev, _Evaluator.add, a, b)),
    "cumprod": _cumulative(lambda ev, a, b: _ieee(ev, _Evaluator.mul, a, b)),
    "cummax": _cumulative(lambda ev, a, b: ev.maximum(a, b, largest=True)),
    "cummin": _cumulative(lambda ev, a, b: ev.maximum(a, b, largest=False)),
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "core_call": _inline,
    "checkpoint": _inline,
    "remat": _inline,
    "remat2": _inline,
    "custom_jvp_call": _inline,
    "custom_vjp_call": _inline,
    "custom_vjp_call_jaxpr": _inline,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
}

# Rules of a few operations each: left to XLA's fusion even on scalars. Control flow
# (cond, while, scan) and calls isolate nothing either: their own equations do.
_SHORT = frozenset(
    {"add", "add_any", "sub", "mul", "max", "min", "clamp", "square", "reduce_max",
     "reduce_min", "reduce_sum", "jit", "pjit", "closed_call", "core_call", "checkpoint",
     "remat", "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
     "cond", "while", "scan"}
)  # fmt: skip

# Exact operations on floats, evaluated as XLA does (then fenced).
_EXACT = frozenset(
    {
        "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "nextafter",
        "copy", "copy_p", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
        "convert_element_type", "bitcast_convert_type", "reduce_precision",
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
        "split", "stack", "unstack", "tile", "zeros_like", "iota", "argmax", "argmin",
        "stop_gradient", "optimization_barrier", "layout_constraint",
        "sharding_constraint", "device_put", "mesh_cast", "reshard",
    }
)  # fmt: skip

# Exact operations whose float results are new values, possibly subnormal.
_CONVERSIONS = frozenset(
    {"convert_element_type", "bitcast_convert_type", "reduce_precision", "nextafter", "iota"}
)

_ORDER = "its result depends on the backend's order of additions and use of fused multiply-adds"
_REASONS = {
    "dot_general": f"a matrix product or contraction; {_ORDER}",
    "conv_general_dilated": f"a convolution; {_ORDER}",
    "reduce_prod": "a product reduction's rounding depends on the backend's order",
    "cumlogsumexp": f"a cumulative log-sum-exp; {_ORDER}",
    "sort": "sorting floats has no canonical rule",
    "scatter": "a scatter's result with repeated indices depends on the backend",
    "scatter-add": f"a scatter-add; {_ORDER}",
    "scatter_add": f"a scatter-add; {_ORDER}",
    "rem": "XLA's float remainder is not exact on every backend",
    "reduce_window_sum": f"a windowed sum; {_ORDER}",
}
