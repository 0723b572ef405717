"""How a ``proof.jit`` step's values are laid out over devices: the shardings the
wrapper pins its hidden outputs to, and the user's ``out_shardings`` per flat output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from zkdv.compilation import ResultSchema, jax_trees

__all__ = [
    "constrain",
    "is_sharding_leaf",
    "layout_of",
    "output_shardings",
    "pin",
    "replicated",
    "spans_devices",
]


def replicated(leaves: Sequence[Any]) -> NamedSharding:
    """A fully replicated sharding on the mesh of the step's inputs (multi-process)."""
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())  # type: ignore[no-untyped-call]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("zkdv",))
    return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def spans_devices(leaves: Sequence[Any]) -> bool:
    """Whether any leaf is laid out over more than one device."""
    return any(
        len(getattr(getattr(leaf, "sharding", None), "device_set", ())) > 1 for leaf in leaves
    )


def layout_of(leaf: Any, default: Sharding) -> Sharding:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, Sharding) else default


def pin(tree: Any, layouts: Sequence[Sharding], default: Sharding) -> Any:
    """Constrain a traced PyTree's leaves to ``layouts`` (one per leaf, else ``default``)."""
    flat, structure = jax.tree.flatten(tree)
    if len(layouts) != len(flat):
        layouts = [default] * len(flat)
    return jax.tree.unflatten(
        structure,
        [constrain(x, s) for x, s in zip(flat, layouts, strict=True)],
    )


def constrain(value: Any, sharding: Sharding) -> Any:
    # Explicit mesh axes make a layout part of the type: only reshard changes it there.
    if isinstance(sharding, NamedSharding) and any(
        kind == jax.sharding.AxisType.Explicit for kind in sharding.mesh.axis_types
    ):
        return jax.sharding.reshard(value, sharding)  # type: ignore[no-untyped-call]
    return jax.lax.with_sharding_constraint(value, sharding)  # type: ignore[no-untyped-call]


def is_sharding_leaf(value: Any) -> bool:
    return value is None or isinstance(value, Sharding | PartitionSpec)


def output_shardings(out_shardings: Any, schema: ResultSchema) -> tuple[Any, ...]:
    """The user's ``out_shardings`` (over the result) per flat program output."""
    trees = jax_trees()
    user_leaves = jax.tree.broadcast(
        out_shardings,
        trees.unflatten(schema.tree, [0] * len(schema.sources)),
        is_leaf=is_sharding_leaf,
    )
    per_output: list[Any] = [None] * schema.outputs
    for source, sharding in zip(
        schema.sources,
        jax.tree.leaves(user_leaves, is_leaf=is_sharding_leaf),
        strict=True,
    ):
        per_output[source] = sharding
    return tuple(per_output)
