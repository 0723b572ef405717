"""Backend-neutral mechanics for compiled training functions.

A compiled training function returns two things: the user's own result PyTree, and
the *hidden* transaction values ZKDV needs (additive deltas, post-update parameters and
optimizer state) plus backend evidence. Both leave the compiled program as one flat
list. :class:`ResultSchema` fixes that list's layout at trace time and rebuilds the
user's result from it on every call, so a leaf the user returns that *is* a transaction
value (the post-update parameters, typically) crosses the program boundary once.

The framework adapters are built on demand: importing this module never imports JAX
or PyTorch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PyTreeAdapter", "ResultSchema", "jax_trees", "torch_trees"]


@dataclass(frozen=True)
class PyTreeAdapter:
    """The three tree operations used by backend-neutral result handling.

    Attributes:
        flatten: ``tree -> (leaves, structure)``.
        leaves: ``tree -> leaves``, the same leaves in the same order as ``flatten``.
        unflatten: ``(structure, leaves) -> tree``. The structure comes first,
            whatever the framework's own argument order is.
    """

    flatten: Callable[[Any], tuple[list[Any], Any]]
    leaves: Callable[[Any], list[Any]]
    unflatten: Callable[[Any, list[Any]], Any]


@functools.cache
def jax_trees() -> PyTreeAdapter:
    """Return the adapter over ``jax.tree_util``; imports JAX on first call."""
    from jax import tree_util

    def flatten(tree: Any) -> tuple[list[Any], Any]:
        leaves, structure = tree_util.tree_flatten(tree)
        return list(leaves), structure

    def leaves(tree: Any) -> list[Any]:
        return list(tree_util.tree_leaves(tree))

    def unflatten(structure: Any, leaves: list[Any]) -> Any:
        return tree_util.tree_unflatten(structure, leaves)

    return PyTreeAdapter(flatten, leaves, unflatten)


@functools.cache
def torch_trees() -> PyTreeAdapter:
    """Return the adapter over ``torch.utils._pytree``; imports PyTorch on first call.

    ``torch.utils._pytree`` is private but is what ``torch.compile``, ``torch.export``
    and AOT Inductor use, so trees registered for those are understood here too.
    """
    from torch.utils import _pytree as pytree

    def flatten(tree: Any) -> tuple[list[Any], Any]:
        leaves, structure = pytree.tree_flatten(tree)
        return list(leaves), structure

    def leaves(tree: Any) -> list[Any]:
        return list(pytree.tree_leaves(tree))

    def unflatten(structure: Any, leaves: list[Any]) -> Any:
        # torch takes (leaves, spec); the adapter's contract is (structure, leaves).
        return pytree.tree_unflatten(leaves, structure)

    return PyTreeAdapter(flatten, leaves, unflatten)


@dataclass(frozen=True)
class ResultSchema:
    """Reconstruct user results without returning transaction values twice.

    The compiled program returns one flat list laid out as::

        [hidden leaves (hidden_leaves) | extra leaves (extra_leaves) | user-only leaves]

    The hidden leaves are the transaction values in ``hidden_tree`` order; the first
    ``delta_leaves`` of them are the additive parameter deltas. Extra leaves are
    backend evidence (hashes, projections) that belong to neither tree. User-only
    leaves are the user's result leaves that are not transaction values, each distinct
    object once.

    Attributes:
        tree: structure of the user's result.
        hidden_tree: structure of the hidden transaction values.
        sources: for every leaf of the user's result, its index in the flat list;
            an index below ``hidden_leaves`` means the user returned that transaction
            value itself.
        hidden_leaves: number of hidden leaves.
        delta_leaves: number of leading hidden leaves that are deltas.
        private_delta: True when no user result leaf aliases a delta, so the pipeline
            owns the delta buffers alone and may release them once committed.
        extra_leaves: number of backend evidence leaves after the hidden ones.
    """

    tree: Any
    hidden_tree: Any
    sources: tuple[int, ...]
    hidden_leaves: int
    delta_leaves: int
    private_delta: bool
    extra_leaves: int

    def __post_init__(self) -> None:
        if self.hidden_leaves < 0 or self.extra_leaves < 0:
            raise ValueError(
                f"ResultSchema leaf counts must be >= 0, got hidden_leaves="
                f"{self.hidden_leaves}, extra_leaves={self.extra_leaves}"
            )
        if not 0 <= self.delta_leaves <= self.hidden_leaves:
            raise ValueError(
                f"ResultSchema delta_leaves={self.delta_leaves} must be within "
                f"hidden_leaves={self.hidden_leaves}"
            )
        own = self.hidden_leaves + self.extra_leaves
        for source in self.sources:
            # Extra leaves are evidence for the pipeline; a user leaf never maps there.
            if source < 0 or self.hidden_leaves <= source < own:
                raise ValueError(f"ResultSchema source {source} is outside the result layout")
        if self.private_delta and any(source < self.delta_leaves for source in self.sources):
            raise ValueError("ResultSchema private_delta is set but the user result holds a delta")

    @classmethod
    def build(
        cls,
        result: Any,
        hidden: Any,
        trees: PyTreeAdapter,
        *,
        delta_leaves: int,
        extra: Sequence[Any] = (),
    ) -> tuple[ResultSchema, list[Any]]:
        """Lay out a traced result and its transaction values as one flat list.

        Leaves are matched by object identity: while tracing, a user result that is
        the post-update parameters is the very tracer registered with the transaction.

        Args:
            result: the user's result PyTree, as returned by the traced function.
            hidden: the transaction values, a PyTree whose first ``delta_leaves``
                leaves are the deltas.
            trees: the backend's pytree operations.
            delta_leaves: number of leading leaves of ``hidden`` that are deltas.
            extra: backend evidence leaves to append after the hidden ones.

        Returns:
            The schema and the flat list the compiled program must return.
        """
        hidden_values, hidden_tree = trees.flatten(hidden)
        user_values, tree = trees.flatten(result)
        flat: list[Any] = [*hidden_values, *extra]
        positions: dict[int, int] = {}
        for index, leaf in enumerate(hidden_values):
            # First occurrence wins, so a value registered twice maps to one source.
            positions.setdefault(id(leaf), index)
        sources: list[int] = []
        for leaf in user_values:
            source = positions.get(id(leaf))
            if source is None:
                source = len(flat)
                flat.append(leaf)
                positions[id(leaf)] = source
            sources.append(source)
        schema = cls(
            tree=tree,
            hidden_tree=hidden_tree,
            sources=tuple(sources),
            hidden_leaves=len(hidden_values),
            delta_leaves=delta_leaves,
            private_delta=not any(source < delta_leaves for source in sources),
            extra_leaves=len(extra),
        )
        return schema, flat

    @property
    def outputs(self) -> int:
        """Length of the flat list the compiled program returns."""
        own = self.hidden_leaves + self.extra_leaves
        return own + len({source for source in self.sources if source >= own})

    def _checked(self, flat: Sequence[Any]) -> Sequence[Any]:
        if len(flat) != self.outputs:
            raise ValueError(
                f"compiled ZKDV function returned {len(flat)} values, expected {self.outputs}"
            )
        return flat

    def hidden_values(self, flat: Sequence[Any]) -> list[Any]:
        """Return the hidden transaction leaves (deltas first)."""
        return list(self._checked(flat)[: self.hidden_leaves])

    def deltas(self, flat: Sequence[Any]) -> list[Any]:
        """Return the delta leaves, a prefix of :meth:`hidden_values`."""
        return list(self._checked(flat)[: self.delta_leaves])

    def extras(self, flat: Sequence[Any]) -> list[Any]:
        """Return the backend evidence leaves."""
        start = self.hidden_leaves
        return list(self._checked(flat)[start : start + self.extra_leaves])

    def user_result(self, flat: Sequence[Any], trees: PyTreeAdapter) -> Any:
        """Rebuild the user's result PyTree, aliasing transaction values it returned."""
        flat = self._checked(flat)
        return trees.unflatten(self.tree, [flat[source] for source in self.sources])

    def split(self, flat: Sequence[Any], trees: PyTreeAdapter) -> tuple[Any, Any]:
        """Split a flat result into ``(user result, hidden transaction values)``.

        Both are PyTrees (``tree`` and ``hidden_tree``); a leaf present in both is the
        same object in both. Extra leaves are available from :meth:`extras`.

        Raises:
            ValueError: ``flat`` does not have :attr:`outputs` entries.
        """
        user = self.user_result(flat, trees)
        hidden = trees.unflatten(self.hidden_tree, self.hidden_values(flat))
        return user, hidden
