"""Backend-neutral bindings for symbolic training transactions.

While a backend traces a training function, a transaction names the parameters,
optimizer state and batch it covers by passing the very objects it received. Binding
records *where* in the function's flattened inputs those objects sit, so every later
invocation can rebuild the same subtrees from its own arguments without tracing again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zkdv.compilation import PyTreeAdapter

__all__ = ["NOT_A_SUBTREE", "InputBinding", "bind_input"]

NOT_A_SUBTREE = "ZKDV transaction {name} must be a subtree of the function inputs"


@dataclass(frozen=True)
class InputBinding:
    """Reconstruct one registered pytree from a training invocation.

    Attributes:
        tree: the registered value's tree structure, as returned by the adapter's
            ``flatten``.
        leaves: for each leaf of the registered value, its index among the flattened
            function inputs.
    """

    tree: Any
    leaves: tuple[int, ...]

    def rebuild(self, input_leaves: Sequence[Any], trees: PyTreeAdapter) -> Any:
        """Return the registered subtree built from one invocation's flattened inputs.

        Args:
            input_leaves: the flattened function inputs of the invocation, in the same
                layout as the inputs that were bound.
            trees: the adapter that produced ``tree``.

        Raises:
            IndexError: ``input_leaves`` is shorter than the bound layout.
        """
        return trees.unflatten(self.tree, [input_leaves[index] for index in self.leaves])


def bind_input(
    inputs: Any,
    value: Any,
    name: str,
    trees: PyTreeAdapter,
) -> InputBinding:
    """Bind a registered subtree to leaf positions in a function ABI.

    Leaves are matched by object identity, not equality: during tracing a transaction
    receives the same tracer (or tensor) objects the function received, and identity
    is the only relation that cannot match an unrelated value by accident. The caller
    must keep ``inputs`` alive for the duration of the call so identities are stable.
    When one object occurs at several input positions, the last one is used.

    Args:
        inputs: the function's (normalized) inputs as one pytree.
        value: the registered transaction value, e.g. ``params_before``.
        name: the transaction field, used in the error message.
        trees: the backend's pytree operations.

    Returns:
        The value's tree structure and, per leaf, its index among the input leaves.

    Raises:
        ValueError: a leaf of ``value`` is not a leaf of ``inputs`` (for example it
            was computed inside the function rather than passed in).
    """

    input_leaves = trees.leaves(inputs)
    positions = {id(leaf): index for index, leaf in enumerate(input_leaves)}
    leaves, tree = trees.flatten(value)
    try:
        indices = tuple(positions[id(leaf)] for leaf in leaves)
    except KeyError as error:
        raise ValueError(NOT_A_SUBTREE.format(name=name)) from error
    return InputBinding(tree, indices)
