"""PyTreeAdapter and ResultSchema: one flat program result, two rebuilt trees."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from zkdv.compilation import PyTreeAdapter, ResultSchema, jax_trees, torch_trees


def test_importing_zkdv_and_its_mechanics_imports_no_framework() -> None:
    code = (
        "import sys, zkdv, zkdv.compilation, zkdv.transaction, zkdv.signature, "
        "zkdv.driver.flowcontrol, zkdv.driver.control\n"
        "zkdv.compilation.PyTreeAdapter\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"


@pytest.fixture(params=["jax", "torch"])
def trees(request: pytest.FixtureRequest) -> PyTreeAdapter:
    pytest.importorskip(request.param)
    return jax_trees() if request.param == "jax" else torch_trees()


def test_adapters_are_built_once(trees: PyTreeAdapter) -> None:
    assert (jax_trees() if trees is jax_trees() else torch_trees()) is trees


def test_adapter_round_trips_with_structure_first(trees: PyTreeAdapter) -> None:
    tree = {"b": [1, 2], "a": (3, {"c": 4})}
    leaves, structure = trees.flatten(tree)
    assert leaves == trees.leaves(tree)
    assert sorted(leaves) == [1, 2, 3, 4]
    assert trees.unflatten(structure, [x * 10 for x in leaves]) == {
        "b": [10, 20],
        "a": (30, {"c": 40}),
    }


class Value:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def test_a_returned_transaction_value_crosses_the_boundary_once(trees: PyTreeAdapter) -> None:
    delta, params, opt = Value("delta"), Value("params"), Value("opt")
    loss, metric = Value("loss"), Value("metric")
    hidden = [[delta], [params], [opt]]
    result = ([params], {"loss": loss, "again": loss, "metric": metric})
    evidence = Value("evidence")

    schema, flat = ResultSchema.build(result, hidden, trees, delta_leaves=1, extra=[evidence])

    # hidden | extra | user-only, each user-only object once
    assert flat[:4] == [delta, params, opt, evidence]
    assert sorted(map(repr, flat[4:])) == ["loss", "metric"]
    assert schema.outputs == len(flat) == 6
    assert (schema.hidden_leaves, schema.delta_leaves, schema.extra_leaves) == (3, 1, 1)
    assert schema.private_delta

    user, transaction = schema.split(flat, trees)
    assert user == result
    assert user[0][0] is params and user[1]["again"] is user[1]["loss"]
    assert transaction == hidden
    assert schema.deltas(flat) == [delta]
    assert schema.hidden_values(flat) == [delta, params, opt]
    assert schema.extras(flat) == [evidence]


def test_the_schema_rebuilds_results_of_later_calls(trees: PyTreeAdapter) -> None:
    delta, params, loss = Value("delta"), Value("params"), Value("loss")
    schema, flat = ResultSchema.build((params, loss), [delta, params], trees, delta_leaves=1)
    later = [Value(f"new-{value!r}") for value in flat]
    user, hidden = schema.split(later, trees)
    assert user == (later[1], later[2])
    assert hidden == [later[0], later[1]]


def test_a_user_result_holding_the_delta_makes_it_shared(trees: PyTreeAdapter) -> None:
    delta, params = Value("delta"), Value("params")
    schema, flat = ResultSchema.build({"d": delta}, [delta, params], trees, delta_leaves=1)
    assert flat == [delta, params]
    assert schema.sources == (0,)
    assert not schema.private_delta


def test_an_empty_result_and_no_transaction_values(trees: PyTreeAdapter) -> None:
    schema, flat = ResultSchema.build((), (), trees, delta_leaves=0)
    assert flat == []
    assert schema.split([], trees) == ((), ())


def test_a_wrong_length_result_is_rejected(trees: PyTreeAdapter) -> None:
    schema, flat = ResultSchema.build(Value("loss"), [Value("d")], trees, delta_leaves=1)
    with pytest.raises(ValueError, match="returned 1 values, expected 2"):
        schema.split(flat[:1], trees)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_leaves": -1}, "must be >= 0"),
        ({"delta_leaves": 3}, "delta_leaves=3 must be within hidden_leaves=2"),
        ({"sources": (2,)}, "source 2 is outside"),
        ({"sources": (0,), "private_delta": True}, "user result holds a delta"),
    ],
)
def test_inconsistent_schemas_are_rejected(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "tree": None,
        "hidden_tree": None,
        "sources": (3,),
        "hidden_leaves": 2,
        "delta_leaves": 1,
        "private_delta": False,
        "extra_leaves": 1,
    }
    with pytest.raises(ValueError, match=message):
        ResultSchema(**{**base, **fields})  # type: ignore[arg-type]


def test_it_lays_out_a_traced_jax_result() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    trees = jax_trees()
    seen: dict[str, ResultSchema] = {}

    def step(params: Any, batch: Any) -> list[Any]:
        delta = -0.5 * batch
        after = params + delta
        result = {"params": after, "loss": jnp.sum(after**2)}
        schema, flat = ResultSchema.build(
            result, {"delta": delta, "params": after}, trees, delta_leaves=1
        )
        seen["schema"] = schema
        return flat

    flat = jax.jit(step)(jnp.ones(3), jnp.arange(3.0))
    schema = seen["schema"]
    assert schema.outputs == len(flat) == 3  # delta, params, loss: params not twice
    user, hidden = schema.split(list(flat), trees)
    assert user["params"] is hidden["params"]
    assert jnp.allclose(hidden["delta"], jnp.array([0.0, -0.5, -1.0]))
    assert float(user["loss"]) == pytest.approx(1.0 + 0.25 + 0.0)
