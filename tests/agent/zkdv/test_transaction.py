"""bind_input: transaction subtrees located among a function's inputs by identity."""

from __future__ import annotations

from typing import Any

import pytest

from zkdv.compilation import PyTreeAdapter, jax_trees, torch_trees
from zkdv.transaction import InputBinding, bind_input


class Leaf:
    """A distinct object per instance, as tracers and tensors are."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Leaf({self.name})"


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    if isinstance(tree, dict):
        leaves: list[Any] = []
        structure = {}
        for key in sorted(tree):
            child_leaves, child = _flatten(tree[key])
            leaves.extend(child_leaves)
            structure[key] = (len(child_leaves), child)
        return leaves, ("dict", structure)
    if isinstance(tree, tuple | list):
        leaves = []
        children = []
        for item in tree:
            child_leaves, child = _flatten(item)
            leaves.extend(child_leaves)
            children.append((len(child_leaves), child))
        return leaves, (type(tree).__name__, children)
    return [tree], ("leaf", None)


def _unflatten(structure: Any, leaves: list[Any]) -> Any:
    kind, children = structure
    if kind == "leaf":
        return leaves[0]
    items = children.items() if kind == "dict" else enumerate(children)
    out: dict[Any, Any] = {}
    offset = 0
    for key, (count, child) in items:
        out[key] = _unflatten(child, leaves[offset : offset + count])
        offset += count
    if kind == "dict":
        return out
    values = [out[index] for index in range(len(children))]
    return tuple(values) if kind == "tuple" else values


PLAIN = PyTreeAdapter(_flatten, lambda tree: _flatten(tree)[0], _unflatten)


def test_it_records_each_leaf_position_among_the_inputs() -> None:
    w, b, m, x = Leaf("w"), Leaf("b"), Leaf("m"), Leaf("x")
    inputs = ({"params": {"w": w, "b": b}, "opt": [m]}, x)
    binding = bind_input(inputs, {"w": w, "b": b}, "params", PLAIN)
    # dict keys flatten sorted: inputs are (m, b, w, x) and the value is (b, w)
    assert binding.leaves == (1, 2)
    assert binding.rebuild(PLAIN.leaves(inputs), PLAIN) == {"w": w, "b": b}


def test_a_binding_rebuilds_the_subtree_from_a_later_invocation() -> None:
    w, m, x = Leaf("w"), Leaf("m"), Leaf("x")
    binding = bind_input((w, m, x), (m, [x]), "opt_state", PLAIN)
    later = [Leaf("w2"), Leaf("m2"), Leaf("x2")]
    assert binding == InputBinding(PLAIN.flatten((m, [x]))[1], (1, 2))
    assert binding.rebuild(later, PLAIN) == (later[1], [later[2]])


def test_equal_but_distinct_values_are_not_a_subtree() -> None:
    inputs = ([1000.5], "batch")
    with pytest.raises(ValueError) as caught:
        bind_input(inputs, [float("1000.5")], "params", PLAIN)
    assert str(caught.value) == "ZKDV transaction params must be a subtree of the function inputs"
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_value_computed_inside_the_function_is_rejected() -> None:
    w = Leaf("w")
    with pytest.raises(ValueError, match="ZKDV transaction batch must be a subtree"):
        bind_input((w,), {"x": Leaf("computed")}, "batch", PLAIN)


def test_an_empty_subtree_binds_to_no_leaves() -> None:
    binding = bind_input((Leaf("w"),), (), "opt_state", PLAIN)
    assert binding.leaves == ()
    assert binding.rebuild([], PLAIN) == ()


def test_it_works_with_the_jax_adapter() -> None:
    jnp = pytest.importorskip("jax.numpy")
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    batch = jnp.arange(4)
    binding = bind_input((params, batch), params, "params", jax_trees())
    assert binding.leaves == (0, 1)  # jax sorts dict keys: b, w
    rebuilt = binding.rebuild(jax_trees().leaves((params, batch)), jax_trees())
    assert rebuilt["w"] is params["w"] and rebuilt["b"] is params["b"]


def test_it_works_with_the_torch_adapter() -> None:
    torch = pytest.importorskip("torch")
    params = [torch.ones(3), torch.zeros(2)]
    batch = {"x": torch.arange(4)}
    binding = bind_input((batch, params), batch, "batch", torch_trees())
    assert binding.leaves == (0,)
    with pytest.raises(ValueError, match="must be a subtree"):
        bind_input((batch, params), [torch.ones(3)], "params", torch_trees())
