"""Lower proof-aware Python execution to a standalone Torch graph function.

The attested function is traced once, on the first transaction, by
``torch.fx.experimental.proxy_tensor.make_fx``: it runs the function on real tensors
and records every ATen operator it dispatches, *including the backward pass* that
``proof.backward`` requests through ``torch.autograd.grad``. (The seed's
``torch._dynamo.export`` with ``trace_autograd_ops`` does not exist in Torch 2.13;
``make_fx`` is the tracer under ``torch.export`` and AOTAutograd, and captures
autograd natively.) The result is a state-free graph::

    (parameters..., buffers..., batch tensors...) -> (gradients..., buffers after...)

The gradients are the ones ``optimizer.step()`` reads: ``proof.backward`` leaves them in
the parameters' ``.grad`` (several calls accumulate micro-batches), and whatever the
function does to them before the step (``clip_grad_norm_``, ``clip_grad_value_``,
unscaling) is traced with them (:mod:`zkdv.torch._capture`). Parameters that do not
require gradients get none, as in eager training.

Two properties are then enforced on the graph:

* no **captured unprepared state**: a tensor the function reads without receiving it
  (the parameters of a module outside the prepared root) appears as a graph constant;
  constants that are only literal tensors created inside the function are allowed;
* no **unreplayable randomness**: random operators must take a generator, which the
  replay binds to one seeded from the committed run seed (:mod:`zkdv.torch._rng`); a
  compiled program may hold none.

The optimizer's transition is not part of the graph: the prepared optimizer's step
marks the gradient boundary, and its functional contract (``torch.optim``'s own
functional core) applies the update in replay, with the step's committed options, as
the platform's replay does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from zkdv.torch import _artifact, _rng
from zkdv.torch._capture import AttestationCapture
from zkdv.torch._guards import Guards, extract
from zkdv.torch._rng import SEEDABLE, UNSEEDABLE, random_kind

__all__ = [
    "COMPILED_RANDOM",
    "DISTRIBUTED_GRADIENT_PROCESSING",
    "NO_OPTIMIZER_STEP",
    "RANDOM_OPERATIONS",
    "UNPREPARED_STATE",
    "LoweredProgram",
    "count_flops",
    "gradient_function",
    "lower",
    "trace",
]

UNPREPARED_STATE = (
    "attested Torch code captured unprepared tensor state ({names}); "
    "pass the owning object through proof.prepare()"
)
RANDOM_OPERATIONS = (
    "attested Torch code contains random operations {operations}; generate randomness "
    "outside the transition and include it in the prepared transaction batch"
)
COMPILED_RANDOM = (
    "attested Torch code contains random operations {operations}, which a compiled "
    "(aot-inductor) program draws differently from eager training; use the default "
    "torch.export program, or generate randomness outside the transition and include it "
    "in the prepared transaction batch"
)
DISTRIBUTED_GRADIENT_PROCESSING = (
    "the attested step modifies gradients between proof.backward() and optimizer.step() "
    "(clipping, unscaling); under DDP or FSDP2 ZKDV replays each rank's backward "
    "separately and cannot yet apply that processing to the averaged gradients, so it "
    "is supported in single-process runs only"
)
NO_OPTIMIZER_STEP = (
    "the attested Torch function must compute a loss, call proof.backward(loss) and "
    "then optimizer.step() on the prepared optimizer"
)

# Literal tensors created inside the traced function become constants that only feed
# these operators; anything else reading a constant is captured external state.
_LITERAL_USERS = frozenset({"aten::lift_fresh_copy", "aten::lift_fresh", "aten::detach"})


@dataclass
class LoweredProgram:
    """A sealed gradient program and its committed bytes.

    Attributes:
        program: callable on the flat inputs, returning the flat outputs.
        material: the exact artifact bytes committed by the transcript.
        kind: ``"aot-inductor"`` or ``"torch.export"``.
        unused: per parameter, True when the attested step gives it no gradient (the
            optimizer skips it, as ``torch.optim`` skips a parameter whose grad is None).
        graph: the traced graph module.
        guards: the batch-dependent branches the program assumes.
    """

    program: _artifact.LoadedProgram
    material: bytearray
    kind: str
    unused: tuple[bool, ...]
    graph: fx.GraphModule
    guards: Guards


def _flat_inputs(
    tensors: tuple[torch.Tensor, ...],
    requires: tuple[bool, ...],
    parameter_count: int,
    buffer_count: int,
    *,
    scaler: bool,
) -> tuple[
    tuple[torch.Tensor, ...],
    tuple[torch.Tensor, ...],
    dict[str, torch.Tensor] | None,
    list[torch.Tensor],
]:
    """The flat gradient function's inputs, split: the parameters (differentiated where
    ``requires`` says they require gradients), the buffers, a GradScaler's state
    (``scaler``: copies) and the batch tensors."""
    parameters = tuple(
        tensor.detach().requires_grad_(wanted)
        for tensor, wanted in zip(tensors[:parameter_count], requires, strict=True)
    )
    buffers = tuple(tensors[parameter_count : parameter_count + buffer_count])
    rest = parameter_count + buffer_count
    scaler_state = None
    if scaler:
        # Copies: the scaler's update changes them in place.
        scaler_state = {
            "growth_tracker": tensors[rest].clone(),
            "scale": tensors[rest + 1].clone(),
        }
        rest += 2
    return parameters, buffers, scaler_state, list(tensors[rest:])


def gradient_function(
    function: Callable[..., Any],
    model: Any,
    optimizer: Any,
    rebuild_batch: Callable[[list[torch.Tensor]], Any],
    parameter_count: int,
    buffer_count: int,
    *,
    world_size: int = 1,
    held: tuple[bool, ...] | None = None,
    scaler: bool = False,
) -> tuple[Callable[..., list[torch.Tensor]], list[bool]]:
    """Wrap the attested ``function(model, optimizer, batch)`` as a flat tensor function.

    The flat function differentiates with respect to the parameters that require
    gradients (frozen ones get none, as in eager training), runs everything the
    function does to the gradients before ``optimizer.step()`` (clipping, unscaling) and
    returns the gradients the step reads, then the buffers after the forward. With a
    prepared GradScaler (``scaler``) its scale and growth tracker are inputs after the
    buffers, and ``found_inf`` and the scale and growth tracker after the step are
    outputs after the buffers (:mod:`zkdv.torch._scaler`).

    Returns:
        The flat function and a list that the first call fills with the per-parameter
        "no gradient" flags.

    Raises:
        RuntimeError: (when called) no optimizer step, or, in a multi-process run,
            gradients modified between ``proof.backward`` and ``optimizer.step()``.
    """
    unused: list[bool] = []
    #: Where the traced step set a generator's state back (activation checkpointing).
    restores: list[str] = []
    requires = tuple(parameter.requires_grad for parameter in model.state_parameters)

    def flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
        parameters, buffers, scaler_state, batch_tensors = _flat_inputs(
            tensors, requires, parameter_count, buffer_count, scaler=scaler
        )
        batch = rebuild_batch(batch_tensors)
        with (
            torch.enable_grad(),
            AttestationCapture(
                model,
                (parameters, buffers),
                optimizer,
                model.state_parameters,
                gradients_on_live=not model.fsdp,
                held=held,
                scaler_state=scaler_state,
            ) as capture,
            model.substituted(capture.model_state),
            _rng.watch_restores(restores),
        ):
            function(model.public, optimizer, batch)
        if capture.transition is None or capture.gradients is None:
            raise RuntimeError(NO_OPTIMIZER_STEP)
        if world_size > 1 and capture.modified():
            raise RuntimeError(DISTRIBUTED_GRADIENT_PROCESSING)
        unused[:] = [gradient is None for gradient in capture.gradients]
        gradients = [
            torch.zeros_like(parameter) if gradient is None else gradient
            for parameter, gradient in zip(parameters, capture.gradients, strict=True)
        ]
        outputs = [*gradients, *capture.model_state[1]]
        if scaler_state is not None:
            found_inf = capture.found_inf
            if found_inf is None:  # the step never unscaled: nothing can have overflowed
                found_inf = torch.zeros((), dtype=torch.float32)
            outputs += [found_inf, scaler_state["growth_tracker"], scaler_state["scale"]]
        return outputs

    flat.rng_restores = restores  # type: ignore[attr-defined]
    return flat, unused


def trace(
    function: Callable[..., Any],
    arguments: tuple[torch.Tensor, ...],
    *,
    kind: str = _artifact.TORCH_EXPORT,
) -> fx.GraphModule:
    """Capture ``function`` once and reject unprepared state and unreplayable randomness.

    Random operators that take a generator (dropout's ``bernoulli_``, ``rand``,
    ``normal``...) are allowed in an eager-kernel (``torch.export``) program: ZKDV draws
    them from a generator it seeds per step (:mod:`zkdv.torch._rng`). Random operators
    without a generator argument, and any random operator in a compiled program, are
    refused.

    Raises:
        RuntimeError: with :data:`UNPREPARED_STATE` or :data:`RANDOM_OPERATIONS`.
    """
    # Reads of tensor values (``if mask.all():``) are allowed: the trace keeps the branch
    # taken, and the batch-dependent ones become guards (zkdv.torch._guards).
    graph = make_fx(function, tracing_mode="real", _error_on_data_dependent_ops=False)(*arguments)
    _one_cpu_device(graph)
    captured = []
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(graph, str(node.target), None)
        if not isinstance(value, torch.Tensor):
            continue
        users = {_schema_name(user) for user in node.users}
        if isinstance(value, torch.nn.Parameter) or not users <= _LITERAL_USERS:
            captured.append(
                f"{node.target}: {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            )
    if captured:
        raise RuntimeError(UNPREPARED_STATE.format(names=", ".join(captured)))
    refused = tuple(
        _schema_name(node)
        for node in graph.graph.nodes
        if random_kind(node) == UNSEEDABLE
        or (random_kind(node) == SEEDABLE and kind != _artifact.TORCH_EXPORT)
    )
    if refused:
        message = RANDOM_OPERATIONS if kind == _artifact.TORCH_EXPORT else COMPILED_RANDOM
        raise RuntimeError(message.format(operations=refused))
    return graph


def _schema_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    schema = getattr(node.target, "_schema", None)
    return None if schema is None else str(schema.name)


def count_flops(graph: fx.GraphModule, arguments: tuple[torch.Tensor, ...]) -> float | None:
    """FLOPs of one call of the traced gradient program, by Torch's FLOP counter.

    The graph runs once on fake tensors (``FakeTensorMode``: shapes only, no compute)
    under ``torch.utils.flop_counter.FlopCounterMode``, which counts the matrix
    products, convolutions and attention of the forward and backward passes (the
    optimizer's elementwise update is not counted, as usual for training FLOPs).

    Returns:
        The count, or None when the graph cannot run on fake tensors (the caller then
        estimates).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(argument.detach()) for argument in arguments]
            with FlopCounterMode(display=False) as counter:
                graph(*fakes)
        return float(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an estimate replaces a count that cannot be made
        return None


def lower(
    function: Callable[..., list[torch.Tensor]],
    arguments: tuple[torch.Tensor, ...],
    *,
    kind: str = _artifact.TORCH_EXPORT,
    unused: list[bool] | None = None,
    first_batch: int | None = None,
) -> LoweredProgram:
    """Capture once and seal a state-free program of the given kind.

    Args:
        function: the flat function (see :func:`gradient_function`).
        arguments: example flat inputs (the first transaction's).
        kind: ``"torch.export"`` (eager kernels, the default) or ``"aot-inductor"``.
        unused: the flags list :func:`gradient_function` fills while tracing.
        first_batch: the index of the first batch tensor among ``arguments`` (reads of
            values computed from batch tensors alone become guards); default: none.

    Raises:
        RuntimeError: the function captures unprepared state or random operators.
        ValueError: an unknown program kind.
    """
    if kind not in (_artifact.AOT_INDUCTOR, _artifact.TORCH_EXPORT):
        raise ValueError(
            f"unknown ZKDV Torch program kind {kind!r}; use "
            f"{_artifact.AOT_INDUCTOR!r} or {_artifact.TORCH_EXPORT!r}"
        )
    graph = trace(function, arguments, kind=kind)
    guards = extract(graph, arguments, len(arguments) if first_batch is None else first_batch)
    flags = tuple(unused or ())
    detached = tuple(argument.detach() for argument in arguments)
    if kind == _artifact.AOT_INDUCTOR:
        program, material = _artifact.roundtrip(graph, detached)
    else:
        program, material = _artifact.export_roundtrip(graph, detached)
    return LoweredProgram(program, material, kind, flags, graph, guards)


def _one_cpu_device(graph: torch.fx.GraphModule) -> None:
    """Name the CPU ``cpu`` in every device argument of the traced graph.

    Eager Torch has one CPU device, but a step that moves tensors to ``cpu:0`` (what
    Accelerate's ``device`` is in a multi-process CPU run) records that name, and the
    export's fake tensors then see two devices.
    """
    cpu = torch.device("cpu")
    for node in graph.graph.nodes:
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu" and device.index is not None:
            node.kwargs = {**node.kwargs, "device": cpu}
    graph.recompile()
