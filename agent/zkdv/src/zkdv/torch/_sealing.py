"""Sealing the attested Torch step: trace it once, lower it, describe where it runs.

The first transaction of a :class:`~zkdv.torch.ZKDV` proof seals the program that every
sampled check (and the platform) replays. :func:`gradient_program` turns the
``@proof.attest`` function into the gradient program and :func:`trace` lowers it
(:mod:`zkdv.torch._lowering`);
:func:`environment` writes down everything a replay must reproduce besides the
program's bytes (the root record's ``env``). The driver (:mod:`zkdv.torch._driver`)
runs these steps in order in ``ZKDV._seal``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from zkdv.config import FLOPS_COUNTED, FLOPS_ESTIMATED
from zkdv.environments import kind_of_backend
from zkdv.torch import _rng, _strides
from zkdv.torch._eager import EagerTransaction, Layout
from zkdv.torch._lowering import LoweredProgram, gradient_function, lower
from zkdv.torch._model import PreparedModel
from zkdv.torch._packing import BatchLayout
from zkdv.torch._prepared import PreparedOptimizer
from zkdv.torch.optimizers import canonical

__all__ = [
    "CUDA_NONDETERMINISTIC",
    "DISTRIBUTED_SCALER",
    "environment",
    "gradient_program",
    "trace",
]

CUDA_NONDETERMINISTIC = (
    "ZKDV on CUDA without torch.use_deterministic_algorithms(True): kernels that add with "
    "atomics (embedding and scatter backward, some cuBLAS paths) round differently on "
    "every run, so a sampled check can differ from training in the last bits, which Adam "
    "turns into a sign flip for coordinates whose gradient is rounding noise. Call "
    "torch.use_deterministic_algorithms(True) and set CUBLAS_WORKSPACE_CONFIG=:4096:8 "
    "before CUDA starts"
)
DISTRIBUTED_SCALER = (
    "ZKDV supports a GradScaler in single-process runs only: under DDP or FSDP2 the replay "
    "averages each rank's gradients after the program, where the scaler's unscaling and "
    "overflow check would have to run"
)


def gradient_program(
    attested: Callable[..., Any],
    model: PreparedModel,
    optimizer: PreparedOptimizer,
    layout: BatchLayout,
    parameters: tuple[torch.Tensor, ...],
    *,
    world_size: int,
) -> tuple[Callable[..., Any], list[bool]]:
    """The attested step as a function of tensors: parameters, buffers, batch to gradients.

    Returns:
        The function, and per parameter whether its gradient is unused.

    Raises:
        RuntimeError: a GradScaler in a multi-process run.
    """
    bridge = optimizer.bridge
    function, unused = gradient_function(
        attested,
        model,
        optimizer,
        layout.rebuild,
        len(parameters),
        len(model.buffer_names),
        world_size=world_size,
        held=bridge.held,
        scaler=bridge.scaled,
    )
    if bridge.scaled and world_size > 1:
        raise RuntimeError(DISTRIBUTED_SCALER)
    return function, unused


def trace(
    function: Callable[..., Any],
    unused: list[bool],
    model: PreparedModel,
    optimizer: PreparedOptimizer,
    layout: BatchLayout,
    transaction: EagerTransaction,
    parameters: tuple[torch.Tensor, ...],
    states: list[dict[str, Any]],
    *,
    kind: str,
) -> tuple[LoweredProgram, tuple[Any, ...]]:
    """Trace the gradient program on the first transaction's inputs and lower it.

    Args:
        function, unused: from :func:`gradient_program`.
        parameters: the (FSDP2: full) parameters the program is traced on.
        states: their optimizer state (the GradScaler's last, when scaled).
        kind: the sealed program kind (``aot-inductor`` or ``torch.export``).

    Returns:
        The lowered program, and the arguments it was traced with (for FLOP counting).

    Raises:
        RuntimeError: random operators whose generators the step restores (their draws
            could not be replayed).
    """
    scaler_state = states[-1] if optimizer.bridge.scaled else {}
    arguments = (
        *parameters,
        *(buffer.clone() for buffer in transaction.buffers_before),
        *(scaler_state[entry].clone() for entry in sorted(scaler_state)),
        *(tensor.detach() for tensor in layout.tensor_leaves(transaction.batch)),
    )
    devices = {parameter.device for parameter in parameters}
    # Tracing runs the step once for real: its random draws must not advance the
    # caller's generators.
    with _rng.StepGenerators(0, devices):
        lowered = lower(
            function,
            arguments,
            kind=kind,
            unused=unused,
            first_batch=len(parameters) + len(model.buffer_names) + len(scaler_state),
        )
    restores = getattr(function, "rng_restores", [])
    if lowered.program.random and restores:
        raise RuntimeError(_rng.RESTORED.format(where=", ".join(sorted(set(restores)))))
    return lowered, arguments


_REDUCED = (torch.bfloat16, torch.float16)


def precision(
    lowered: LoweredProgram, parameters: tuple[torch.Tensor, ...], device: torch.device
) -> dict[str, Any]:
    """What the gradient program computes in: ``float32``, or ``reduced`` and why.

    Reduced precision (bfloat16 or float16 autocast or parameters, TF32 or bfloat16
    matrix products) rounds far coarser, so its honest divergence across hardware, and
    the default :class:`~zkdv.config.GradientBounds`, are larger.
    """
    reasons = []
    if any(parameter.dtype in _REDUCED for parameter in parameters):
        reasons.append("reduced-precision parameters")
    values = (node.meta.get("val") for node in lowered.graph.graph.nodes)
    if any(isinstance(value, torch.Tensor) and value.dtype in _REDUCED for value in values):
        reasons.append("bfloat16 or float16 operations (autocast)")
    if torch.get_float32_matmul_precision() != "highest":
        reasons.append(f"float32 matmul precision {torch.get_float32_matmul_precision()!r}")
    if device.type == "cuda" and (
        torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    ):
        reasons.append("TF32 matrix products or convolutions on CUDA")
    return {"kind": "reduced" if reasons else "float32", "reasons": reasons}


def environment(
    *,
    model: PreparedModel,
    optimizer: PreparedOptimizer,
    lowered: LoweredProgram,
    layout: BatchLayout,
    leaves: Layout,
    parameters: tuple[torch.Tensor, ...],
    state_leaves: list[torch.Tensor],
    buffers_before: tuple[torch.Tensor, ...],
    device: torch.device,
    world_size: int,
    run_seed: int | None,
    program_flops: float | None,
) -> dict[str, Any]:
    """The root record's ``env``: what a replay must reproduce besides the program."""
    bridge = optimizer.bridge
    return {
        # What the gradient program computes in (the default gradient bounds follow it).
        "precision": precision(lowered, parameters, device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": str(device),
        # The kind a run's replays are routed by (zkdv.environments), and the chip.
        "platform_kind": kind_of_backend(device.type),
        "device_kind": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # On a GPU, the runtime under the kernels (cuBLAS and cuDNN pick by version).
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,  # type: ignore[no-untyped-call]
        # The CPU kernels Torch dispatches to (AVX2, AVX512...): a replay on another
        # instruction set may round differently, so exactness is claimed only on this.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "world_size": world_size,
        # FSDP2: world size, device mesh and placements; the committed state is the
        # full (gathered) state, and a replay of the full model is never bit-exact.
        "fsdp": model.mesh,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        # How each step record's FLOPs were obtained (attestations/certificates/totals.py
        # reads it).
        "flops": {
            "method": FLOPS_COUNTED if program_flops is not None else FLOPS_ESTIMATED,
            "per_rank": program_flops,
        },
        "optimizer": _optimizer_record(model, optimizer),
        # A GradScaler's options; its state is committed with the optimizer's.
        "grad_scaler": bridge.scaler_options,
        # The seed of the step's random operators (dropout), when it has any.
        "rng": None if run_seed is None else {"seed": run_seed, "derivation": _rng.RNG_VERSION},
        "batch": layout.to_dict(),
        # Leaves whose memory format is not C order (channels_last): every replay
        # rebuilds them so, or its kernels would differ from training's.
        "dim_orders": {
            "params": _strides.orders(model.parameter_names, parameters),
            "opt_state": _strides.orders(leaves.state_paths, state_leaves),
            "buffers": _strides.orders(model.buffer_names, buffers_before),
        },
        "program": {
            "kind": lowered.kind,
            "inputs": ["parameters", "buffers", "batch tensors"],
            "outputs": ["gradients", "buffers after"],
            "unused_gradients": [
                name
                for name, skip in zip(model.parameter_names, lowered.unused, strict=True)
                if skip
            ],
            # Values read from the batch that the program branched on at sealing;
            # every later batch is checked to read the same (zkdv.torch._guards).
            "guards": lowered.guards.to_record(),
        },
    }


def _optimizer_record(model: PreparedModel, optimizer: PreparedOptimizer) -> dict[str, Any]:
    """The root record's ``env.optimizer``: everything a server needs to rebuild the
    optimizer's transition (the contract, every group's options and which parameters
    each group holds) and the update training applied."""
    bridge = optimizer.bridge
    return {
        "contract": bridge.contract.name,
        "groups": bridge.options(),
        "group_parameters": _group_parameters(model, optimizer),
        # Per group, the options every step record's ``hp`` carries.
        "dynamic": [list(names) for names in bridge.dynamic],
        # The update training applied: the canonical one (bitwise reproducible on any
        # hardware, zkdv.torch.optimizers.canonical), or the contract's own.
        "canonical": canonical.CANONICAL_VERSION if bridge.canonical else None,
        "canonical_reason": bridge.canonical_reason,
    }


def _group_parameters(model: PreparedModel, optimizer: PreparedOptimizer) -> list[list[str]]:
    """The committed parameter names each optimizer parameter group holds, in order."""
    names = {
        id(parameter): name
        for name, parameter in zip(model.parameter_names, model.state_parameters, strict=True)
    }
    return [
        [names[id(parameter)] for parameter in group["params"]]
        for group in optimizer.optimizer.param_groups
    ]
