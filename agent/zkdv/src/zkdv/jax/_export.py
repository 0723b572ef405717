"""Exporting the attested JAX program: what ``proof.jit`` and ``proof.attest`` commit.

The artifact (:mod:`zkdv.jax.artifact`) holds, for a run that commits its gradients,
the production step and the apply program (:func:`export_committed`); otherwise the
attested function and, when it can be derived, the full one-update transition. Each is
exported with ``jax.export`` for the training platform and the common replay platforms.
The root record's environment (:func:`_environment`, with the program's
:func:`precision`) and sharding descriptions come from here too.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import NamedSharding

from zkdv import environments
from zkdv.config import GradientBounds
from zkdv.errors import (
    ZKDVError,
)
from zkdv.gradients import leaf_name
from zkdv.jax import _context, _messages
from zkdv.jax._flops import FLOP_METHOD
from zkdv.jax._optimizer import UpdateSpec, apply_function, deltas, optimizer_env
from zkdv.jax._tree import index
from zkdv.jax.artifact import CANONICAL_OPTIONS, Artifact, dumps_committed

if TYPE_CHECKING:
    from zkdv.jax._program import _Program, _Traced

__all__ = [
    "ISAS",
    "REPLAY_PLATFORMS",
    "donates_params",
    "exact_environment_values",
    "export_candidates",
    "export_committed",
    "follower_calls",
    "one_update_material",
    "partitioned_calls",
    "precision",
    "state_shardings",
    "step_calls",
]

# The artifact's ``source``: what declared the transaction whose program is generated.
_SOURCES = {"train_state": "zkdv.jax.contrib.TrainState", "nnx": "flax.nnx.Optimizer"}


def _spec(shape: Any, dtype: Any) -> Any:
    return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]


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


#: XLA CPU instruction sets, in order (``--xla_cpu_max_isa`` values), each with the
#: ``/proc/cpuinfo`` flag that says the CPU has it.
ISAS = (
    ("SSE4_2", "sse4_2"),
    ("AVX", "avx"),
    ("AVX2", "avx2"),
    ("AVX512", "avx512f"),
    ("AVX512_VNNI", "avx512_vnni"),
    ("AVX512_BF16", "avx512_bf16"),
    ("AMX", "amx_bf16"),
)
#: CPU flags that change the code XLA's CPU backend generates (or its tuning).
_CPU_FEATURES = frozenset(
    {flag for _, flag in ISAS} | {"fma", "f16c", "avx_vnni", "amx_int8", "amx_tile", "avx512vl"}
)


def _cpu() -> dict[str, Any]:
    """The CPU as XLA's code generation sees it: ``cpu_isa``, the instruction set XLA
    compiles for (the CPU's best, capped by ``--xla_cpu_max_isa`` in ``XLA_FLAGS``),
    ``cpu_model`` and ``cpu_features``, the flags that change its code or tuning."""
    model, flags = "unknown", set[str]()
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle,
    ):
        for line in handle:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    best = None
    for name, flag in ISAS:
        if flag in flags:
            best = name
    cap = None
    for option in os.environ.get("XLA_FLAGS", "").split():
        if option.startswith("--xla_cpu_max_isa="):
            cap = option.partition("=")[2].strip().upper()
    names = [name for name, _ in ISAS]
    isa = best
    if cap in names and (best is None or names.index(cap) < names.index(best)):
        isa = cap
    return {
        "cpu_isa": isa or "unknown",
        "cpu_model": model,
        "cpu_features": sorted(flags & _CPU_FEATURES),
    }


def _threads() -> int:
    """The CPUs this process may run on: XLA's CPU thread pool is sized by them, and a
    reduction may split across its threads differently with another count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _environment(
    *,
    platforms: Sequence[str] = (),
    precision: dict[str, Any] | None = None,
    update: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The root record's ``env``: versions, devices, and what changes the bits.

    A replay reproduces a JAX step bit for bit only on the same backend, XLA build,
    device kinds, CPU (model, instruction set) and thread count, with the same
    ``XLA_FLAGS``, 64-bit mode and default matmul precision: all recorded here
    (``provers.jax_replay.exact_environment`` compares them).
    """
    import jaxlib

    env: dict[str, Any] = {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "jax_platform": jax.default_backend(),
        "devices": sorted({device.device_kind for device in jax.devices()}),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "x64": bool(getattr(jax.config, "jax_enable_x64", False)),
        **exact_environment_values(),
        "export_platforms": list(platforms),
    }
    if precision is not None:
        env["precision"] = precision
    if update is not None:
        env["update"] = update
    env["flops"] = {"method": FLOP_METHOD}
    for name in ("flax", "optax"):
        with contextlib.suppress(ImportError):
            env[name] = __import__(name).__version__
    return env


def exact_environment_values() -> dict[str, Any]:
    """This process's values of everything that changes a JAX program's bits.

    The backend (and its platform kind), XLA build and device kinds, the CPU
    (:func:`_cpu`), the thread count (:func:`_threads`), ``XLA_FLAGS``, 64-bit mode, the
    default matmul precision and, for an accelerator, its runtime (:func:`_runtime`).
    :func:`zkdv.environments.replay_environment` reads the key of a run from them.
    """
    import jaxlib

    backend = jax.default_backend()
    return {
        "jax_platform": backend,
        # The kind a run's replays are routed by (zkdv.environments, looked up there so
        # that the platform's routing tests can read a CPU as a TPU), and the chip
        # generation ("TPU v5 lite"; "cpu" on a CPU, whose generation is cpu_isa).
        "platform_kind": environments.kind_of_backend(backend),
        "device_kind": jax.devices()[0].device_kind,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "devices": sorted({device.device_kind for device in jax.devices()}),
        "threads": _threads(),
        **_cpu(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": bool(getattr(jax.config, "jax_enable_x64", False)),
        "matmul_precision": _matmul_precision(),
        **_runtime(),
    }


def _runtime() -> dict[str, Any]:
    """What runs under XLA on an accelerator: the backend's ``platform_version`` (on a
    TPU, libtpu's build), the ``libtpu`` distribution's version (None where it is not
    installed) and ``LIBTPU_INIT_ARGS``, the runtime's own flags, which can change the
    code it generates."""
    version = None
    with contextlib.suppress(Exception):  # a backend without the attribute, or none yet
        from jax.extend import backend as _backend

        version = str(_backend.get_backend().platform_version)
    libtpu = None
    for name in ("libtpu", "libtpu-nightly"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            libtpu = importlib.metadata.version(name)
            break
    return {
        "platform_version": version,
        "libtpu": libtpu,
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    }


def _matmul_precision() -> str:
    value = getattr(jax.config, "jax_default_matmul_precision", None)
    return "default" if value is None else str(value)


_REDUCED = ("bfloat16", "float16")
#: Backends whose default matrix-product precision is below float32 (TF32, bfloat16).
_REDUCED_DEFAULT_MATMUL = ("gpu", "cuda", "rocm", "tpu")


def precision(jaxpr: Any, params: Sequence[Any], platform: str) -> dict[str, Any]:
    """What the gradient program computes in: ``{"kind": "float32" | "reduced", "reasons"}``.

    Reduced: a bfloat16 or float16 parameter or operation, or a matrix product at the
    backend's default precision where that default is below float32 (TF32 or bfloat16
    passes on GPUs and TPUs) and ``jax_default_matmul_precision`` does not raise it.
    """
    reasons: list[str] = []
    narrow = sorted({str(jnp.result_type(p)) for p in params} & set(_REDUCED))
    if narrow:
        reasons.append(f"{' and '.join(narrow)} parameters")
    primitives: dict[str, set[str]] = {}
    matmul_default = False
    for eqn in _equations(jaxpr):
        for var in eqn.outvars:
            dtype = str(getattr(var.aval, "dtype", ""))
            if dtype in _REDUCED:
                primitives.setdefault(dtype, set()).add(eqn.primitive.name)
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            chosen = eqn.params.get("precision")
            if chosen is None or all(
                p is None or str(p).upper().endswith("DEFAULT") for p in _flat(chosen)
            ):
                matmul_default = True
    for dtype, names in sorted(primitives.items()):
        reasons.append(f"{dtype} operations ({', '.join(sorted(names)[:4])})")
    high = _matmul_precision().lower() in ("highest", "float32", "tensorfloat32_off")
    if matmul_default and platform in _REDUCED_DEFAULT_MATMUL and not high:
        reasons.append(
            f"matrix products at {platform}'s default precision (TF32 or bfloat16 passes); "
            "jax_default_matmul_precision='highest' keeps float32"
        )
    return {"kind": "reduced" if reasons else "float32", "reasons": reasons}


#: ``env.flops.method`` of a JAX root: what each step record's ``flops`` counts. The
#: same thing Torch's FLOP counter counts in zkdv.torch, so one workload claims the same
#: compute in both frameworks; XLA's cost analysis counts every elementwise operation
#: too, and only one device's partition of an SPMD program.
def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, tuple | list) else [value]


def _equations(jaxpr: Any) -> Any:
    from jax.extend import core as jax_core

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in inner.eqns:
        yield eqn
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


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


def export_candidates() -> list[tuple[str, ...]]:
    """Platform sets to lower for, in order: the training one and the replay ones, then
    the training platform alone (when an operation cannot be lowered for the others)."""
    local = jax.default_backend()
    extra = tuple(p for p in dict.fromkeys(_replay_platforms()) if p != local)
    return [(local, *extra), (local,)] if extra else [(local,)]


def export_committed(
    production: Any, specs: tuple[Any, Any, Any], apply: Callable[..., Any], apply_specs: Any
) -> tuple[export.Exported, export.Exported]:
    """Export the production step and the apply program of a run that commits gradients.

    Both for the same platforms (module docstring); the production program with the
    step's ``jax.jit`` options and donation, ``apply`` plainly.

    Raises:
        ZKDVError: neither exports (``EXPORT_FAILURE``, with the last platform's error).
    """
    failure: Exception | None = None
    for platforms in export_candidates():
        try:
            exported = export.export(production, platforms=platforms)(*specs)
            applied = export.export(jax.jit(apply), platforms=platforms)(*apply_specs)
            return exported, applied
        except ZKDVError:
            raise
        except Exception as error:  # noqa: BLE001 - retried for the local platform only
            failure = error
    assert failure is not None
    raise ZKDVError(_messages.EXPORT_FAILURE.format(error=failure)) from failure


def _apply_state_specs(program: _Program) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
    """The apply program's parameter, optimizer-state and zero specs: the step's own."""
    assert program.specs is not None
    traced = program.traced
    inputs = [*program.specs[0], *program.specs[1]]
    by_position = {
        position: inputs[i] for i, position in enumerate((*program.donated, *program.kept))
    }
    zero_spec = program.specs[2]
    apply_params = tuple(by_position[p] for p in traced.param_positions)
    apply_opt = tuple(by_position[p] for p in traced.opt_positions)
    return apply_params, apply_opt, zero_spec


def _computed_specs(program: _Program, weak: Sequence[bool]) -> tuple[Any, ...]:
    """The apply program's specs of the computed values, as the production trace outputs
    them, with the weak types the update declared."""
    computed_avals = program.trace.out_info[1 : 1 + len(program.traced.computed_names)]
    return tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=w)  # type: ignore[no-untyped-call]
        for a, w in zip(computed_avals, weak, strict=True)
    )


def _committed_material(
    program: _Program,
    exported: tuple[export.Exported, export.Exported],
    computed: tuple[Any, ...],
    optimizer: dict[str, Any],
    state_specs: tuple[tuple[Any, ...], tuple[Any, ...]],
) -> bytes:
    """The version-2 artifact of a run that commits its gradients (:func:`dumps_committed`).

    ``exported`` is the production and the apply program, ``computed`` the apply
    program's specs of the computed values, ``state_specs`` the parameters' and the
    optimizer state's.
    """
    traced = program.traced
    production, applied = exported
    param_specs, opt_specs = state_specs
    return dumps_committed(
        source=_SOURCES.get(traced.registration.source, "zkdv.jax.Transaction"),
        production=production,
        apply=applied,
        inputs={
            "count": len(program.avals),
            "donated": list(program.donated),
            "kept": list(program.kept),
            "params": list(traced.param_positions),
            "opt_state": list(traced.opt_positions),
            "batch": list(traced.batch_positions),
        },
        outputs={
            "batch": 0,
            "computed": 1,
            "count": traced.schema.outputs - traced.schema.hidden_leaves,
        },
        computed=list(zip(traced.computed_names, computed, strict=True)),
        optimizer=optimizer,
        params=list(zip(traced.param_paths, param_specs, strict=True)),
        opt_state=list(zip(traced.opt_paths, opt_specs, strict=True)),
        layout=traced.layout,
    )


def one_update_material(
    traced: _Traced,
    spec: UpdateSpec,
    program: Callable[..., Any],
    computed: Sequence[Any],
    jaxpr: Any,
    state: tuple[Sequence[Any], Sequence[Any]],
) -> tuple[bytes, tuple[str, ...], dict[str, Any], GradientBounds]:
    """The version-2 artifact of a ``zkdv.jax.scan`` whose updates commit gradients.

    Its programs are one update's (``zkdv.jax._scan``): ``program``, the gradient
    program over ``((), (params..., opt_state..., unpacked batch...), zero)``, nothing
    donated, and the canonical update of ``spec``. ``computed`` holds the computed
    values' avals, ``jaxpr`` the traced body, ``state`` the parameters and optimizer
    state.

    Returns:
        The artifact's bytes, the computed values' names, the root's ``env`` and the
        run's default gradient bounds.
    """
    params, opt = state
    param_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in params)
    opt_specs = tuple(_spec(jnp.shape(x), jnp.result_type(x)) for x in opt)
    zero_spec = _spec((), jnp.uint32)
    layout = traced.layout
    packed = _spec((layout.rows, layout.cols), jnp.uint32)
    kept = (*param_specs, *opt_specs, *jax.eval_shape(layout.unpack, packed))
    computed_specs = tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=weak)  # type: ignore[no-untyped-call]
        for a, weak in zip(computed, spec.weak[2], strict=True)
    )
    apply, outcome = apply_function(spec)
    exported, applied = export_committed(
        jax.jit(program),
        ((), kept, zero_spec),
        apply,
        (param_specs, opt_specs, computed_specs, zero_spec),
    )
    names = tuple(leaf_name("params", traced.param_paths[p]) for p in spec.grads) + tuple(
        leaf_name("opt_state", traced.opt_paths[p]) for p in spec.carried
    )
    nstate = len(params) + len(opt)
    optimizer = optimizer_env(outcome[0] if outcome else None)
    material = dumps_committed(
        source=_SOURCES["train_state"] + " in zkdv.jax.scan",
        production=exported,
        apply=applied,
        inputs={
            "count": len(kept),
            "donated": [],
            "kept": list(range(len(kept))),
            "params": list(range(len(params))),
            "opt_state": list(range(len(params), nstate)),
            "batch": list(range(nstate, len(kept))),
        },
        outputs={"batch": 0, "computed": 1, "count": 1 + len(names)},
        computed=list(zip(names, computed_specs, strict=True)),
        optimizer=optimizer,
        params=list(zip(traced.param_paths, param_specs, strict=True)),
        opt_state=list(zip(traced.opt_paths, opt_specs, strict=True)),
        layout=layout,
    )
    kind = precision(jaxpr, params, jax.default_backend())
    env = _environment(platforms=exported.platforms, precision=kind, update=optimizer)
    return material, names, env, GradientBounds.default(kind["kind"])


def _export_programs(
    attest: Callable[..., Any],
    options: dict[str, Any],
    transition: Callable[..., Any] | None,
    specs: tuple[Any, Any, Any, Any],
) -> tuple[export.Exported, export.Exported | None]:
    params, opt, batch, index_spec = specs
    failure: Exception | None = None
    for platforms in export_candidates():
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


def step_calls(
    artifact: Artifact,
    program: _Program,
    apply: Callable[..., Any],
    specs: tuple[Any, Any, Any, Any],
    state: tuple[Sequence[Any], Sequence[Any]],
    *,
    donating: bool,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """What a run that commits its gradients calls each step: its gradient program and
    its canonical update.

    On one device, the committed programs themselves, compiled once here and shared
    with the artifact's own calls (the SDK's checks); an apply program that donates the
    parameters is compiled apart (a check compiles its own at its first call). A step
    whose arguments lie on several devices of this process (``program.spans_devices``;
    ``state``, the parameters and the optimizer state it received, gives the update's
    output layouts) runs the traced step under the
    user's shardings (XLA partitions it) and the same canonical update partitioned
    alike, keeping each leaf's layout: the committed single-device programs cannot take
    sharded arguments, and serve the checks and the platform's replays. The canonical
    update's arithmetic is elementwise, and its sums are exact integer sums, so its
    bits do not depend on the partitioning; the gradient's reductions do, which is why
    such a step is judged within the gradient bounds (``provers.jax_replay``).
    """
    if program.spans_devices:
        return partitioned_calls(program, apply, state, donating=donating)
    assert program.specs is not None
    compute = artifact.compiled("production", *program.specs)
    if donating:
        return compute, artifact.donating_apply(*specs)
    return compute, artifact.compiled("apply", *specs)


def partitioned_calls(
    program: _Program,
    apply: Callable[..., Any],
    state: tuple[Sequence[Any], Sequence[Any]],
    *,
    donating: bool,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """:func:`step_calls` of a step whose arguments lie on several devices: the traced
    step and the canonical update, both partitioned by XLA over the user's layouts.

    Under several processes every process calls these (the same collectives); only
    rank 0 exports and commits the single-device programs.
    """
    params, opt_state = state
    outputs = (
        tuple(leaf.sharding for leaf in params),
        tuple(leaf.sharding for leaf in opt_state),
    )
    canonical = jax.jit(
        apply,
        donate_argnums=(0,) if donating else (),
        out_shardings=outputs,
        compiler_options=CANONICAL_OPTIONS,
    )
    return program.jitted, canonical


def donates_params(program: _Program) -> bool:
    """Whether the realized deltas may reuse the pre-update parameters' buffers: the
    step donates every parameter, in one process (several have no mutation barrier, so
    rank 0's commit stage may still read the buffers as the previous post-update state).
    """
    return (
        jax.process_count() == 1
        and bool(program.donated)
        and all(position in program.donated for position in program.traced.param_positions)
    )


def follower_calls(
    program: _Program, state: tuple[Sequence[Any], Sequence[Any]]
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """A follower's step, canonical update and realized deltas in a run that commits its
    gradients: rank 0's, so every process issues the same collectives."""
    assert program.traced.update is not None
    apply, _ = apply_function(program.traced.update)
    changes = jax.jit(deltas, donate_argnums=(1,) if donates_params(program) else ())
    return (*partitioned_calls(program, apply, state, donating=False), changes)


def state_shardings(params: Sequence[Any], opt_state: Sequence[Any]) -> dict[str, Any] | None:
    """The root record's ``schema.sharding``: each committed leaf's layout
    (:func:`_describe_sharding`), or None when no leaf is sharded."""
    shardings = {
        "params": [_describe_sharding(x) for x in params],
        "opt_state": [_describe_sharding(x) for x in opt_state],
    }
    if any(s is not None for tree in shardings.values() for s in tree):
        return shardings
    return None
