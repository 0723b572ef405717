"""FunctionSignature: a stable positional ABI for compiled training functions."""

from __future__ import annotations

from typing import Any

import pytest

from zkdv.signature import FunctionSignature


def step(state: Any, batch: Any, lr: float = 0.1, *, train: bool = True) -> Any:
    return state, batch, lr, train


def test_it_lists_parameter_names_in_declaration_order() -> None:
    assert FunctionSignature(step).names == ("state", "batch", "lr", "train")


def test_it_normalizes_named_and_positional_calls_to_one_tuple() -> None:
    signature = FunctionSignature(step)
    expected = ("s", "b", 0.1, True)
    assert signature.bind("s", "b") == expected
    assert signature.bind(batch="b", state="s") == expected
    assert signature.bind("s", batch="b", lr=0.1) == expected
    assert signature.bind("s", "b", 0.5, train=False) == ("s", "b", 0.5, False)


def test_it_calls_the_function_back_from_the_tuple_with_keyword_only_by_name() -> None:
    signature = FunctionSignature(step)
    values = signature.bind("s", "b", train=False)
    assert signature.arguments(values) == (("s", "b", 0.1), {"train": False})
    assert signature.call(values) == ("s", "b", 0.1, False)


def test_it_rejects_a_tuple_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="expected 4 normalized arguments, got 3"):
        FunctionSignature(step).arguments(("s", "b", 0.1))


@pytest.mark.parametrize(
    "function",
    [lambda *args: None, lambda state, **kwargs: None, lambda state, *rest, lr=1: None],
)
def test_it_rejects_variadic_functions(function: Any) -> None:
    with pytest.raises(TypeError, match=r"^ZKDV.attest does not support variadic training"):
        FunctionSignature(function, "ZKDV.attest")


def test_its_default_api_name_is_zkdv_jit() -> None:
    with pytest.raises(TypeError, match=r"^ZKDV.jit does not support variadic"):
        FunctionSignature(lambda *args: None)


def test_a_mismatched_call_names_the_api() -> None:
    signature = FunctionSignature(step)
    with pytest.raises(TypeError, match=r"^ZKDV\.jit: missing a required argument: 'batch'"):
        signature.bind("s")
    with pytest.raises(TypeError, match=r"^ZKDV\.jit: got an unexpected keyword"):
        signature.bind("s", "b", momentum=0.9)


def test_it_maps_argnums_and_argnames_both_ways() -> None:
    signature = FunctionSignature(step)
    assert signature.argnums(2) == (2,)
    assert signature.argnums([3, -4, 3]) == (0, 3)
    assert signature.argnums(None) == ()
    assert signature.argnames("lr") == ("lr",)
    assert signature.argnames(["train", "state"]) == ("state", "train")
    assert signature.names_of((1, -1)) == ("batch", "train")
    assert signature.argnums_of(("train", "batch")) == (1, 3)
    assert signature.position("lr") == 2


def test_static_options_are_reconciled_into_one_set() -> None:
    signature = FunctionSignature(step)
    assert signature.static() == ((), ())
    assert signature.static(static_argnums=2) == ((2,), ("lr",))
    assert signature.static(static_argnames="train") == ((3,), ("train",))
    assert signature.static(2, ("train", "lr")) == ((2, 3), ("lr", "train"))


def test_it_splits_dynamic_and_static_values() -> None:
    signature = FunctionSignature(step)
    values = signature.bind("s", "b", 0.5)
    assert signature.split(values, (2, 3)) == (("s", "b"), (0.5, True))


@pytest.mark.parametrize("bad", [4, -5, (0, 9)])
def test_out_of_range_argnums_are_rejected_with_the_value(bad: Any) -> None:
    with pytest.raises(ValueError, match="out of range for 4 parameters"):
        FunctionSignature(step).argnums(bad)


@pytest.mark.parametrize("bad", [True, 1.0, "lr"])
def test_non_integer_argnums_are_rejected(bad: Any) -> None:
    with pytest.raises(TypeError, match="argnums must be integers"):
        FunctionSignature(step).argnums([bad])


def test_unknown_argnames_are_rejected_with_the_name() -> None:
    signature = FunctionSignature(step)
    with pytest.raises(ValueError, match="no parameter named 'momentum'"):
        signature.argnames("momentum")
    with pytest.raises(TypeError, match="argnames must be strings"):
        signature.argnames([1])  # type: ignore[list-item]


def test_a_function_without_parameters_has_an_empty_abi() -> None:
    signature = FunctionSignature(lambda: 1)
    assert signature.names == ()
    assert signature.bind() == ()
    assert signature.call(()) == 1
    assert signature.static() == ((), ())
