"""Exporting the attested JAX program: what ``proof.jit`` and ``proof.attest`` commit.

The artifact (:mod:`zkdv.jax.artifact`) holds the attested function and, when it can be
derived, the full one-update transition, both exported with ``jax.export`` for the
training platform and the common replay platforms. The root record's environment
(:func:`_environment`) and sharding descriptions come from here too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import NamedSharding

from zkdv.errors import (
    ZKDVError,
)
from zkdv.jax import _context, _messages
from zkdv.jax._tree import index

if TYPE_CHECKING:
    from zkdv.jax._program import _Traced

__all__ = ["REPLAY_PLATFORMS"]

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
