"""Framework-independent callable signature normalization.

A compiled training function is cached and committed by its *positional ABI*: the tuple
of every parameter's value in declaration order, defaults applied. Two calls that name
the same arguments differently (``step(state, batch)`` and ``step(batch=b, state=s)``)
therefore reach the same compiled program and the same transcript encoding.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["FunctionSignature"]

VARIADIC = "{api} does not support variadic training functions"

_UNSUPPORTED = frozenset({inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD})


def _as_tuple(value: Any, kind: type) -> tuple[Any, ...]:
    # jax.jit accepts both a single int/str and any iterable of them for its static
    # options; mirror that so wrappers can forward user options unchanged.
    if value is None:
        return ()
    if isinstance(value, kind):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(value)
    return (value,)


class FunctionSignature:
    """Normalize ordinary named arguments into a stable positional ABI.

    Every parameter of the function, keyword-only ones included, has one position in
    the ABI: its index in declaration order. :meth:`bind` maps a call onto that tuple
    and :meth:`call` maps the tuple back onto the function, so a wrapper may trace,
    cache and commit the positional form while the user keeps calling by name.

    Args:
        function: the training function. Its signature is read once, here.
        api: the public API name used in error messages, e.g. ``"ZKDV.attest"``.

    Raises:
        TypeError: ``function`` takes ``*args`` or ``**kwargs``; a variadic ABI has no
            stable positions to commit.
        ValueError: ``function`` has no introspectable signature (some builtins).
    """

    def __init__(self, function: Callable[..., Any], api: str = "ZKDV.jit") -> None:
        self.function = function
        self.api = api
        self.signature = inspect.signature(function)
        parameters = tuple(self.signature.parameters.values())
        if any(parameter.kind in _UNSUPPORTED for parameter in parameters):
            raise TypeError(VARIADIC.format(api=api))
        self.names: tuple[str, ...] = tuple(parameter.name for parameter in parameters)
        # Keyword-only parameters are positions in the ABI but must be passed back by
        # name; everything before the first of them can be passed positionally.
        self._keyword_only = frozenset(
            parameter.name
            for parameter in parameters
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        )
        self._positions = {name: index for index, name in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"FunctionSignature({self.api}, {self.names!r})"

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Return the call's arguments as one value per parameter, in declaration order.

        Defaults are applied, so omitting an argument and passing its default give the
        same tuple.

        Raises:
            TypeError: the call does not match the signature (missing, unexpected or
                duplicated arguments); the message names the API.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.api}: {error}") from None
        bound.apply_defaults()
        return tuple(bound.arguments[name] for name in self.names)

    def arguments(self, values: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Split an ABI tuple back into ``(args, kwargs)`` accepted by the function.

        Raises:
            ValueError: ``values`` does not have one entry per parameter.
        """
        if len(values) != len(self.names):
            raise ValueError(
                f"{self.api} expected {len(self.names)} normalized arguments, got {len(values)}"
            )
        args = tuple(
            value
            for name, value in zip(self.names, values, strict=True)
            if name not in self._keyword_only
        )
        kwargs = {
            name: value
            for name, value in zip(self.names, values, strict=True)
            if name in self._keyword_only
        }
        return args, kwargs

    def call(self, values: Sequence[Any]) -> Any:
        """Call the function with an ABI tuple produced by :meth:`bind`."""
        args, kwargs = self.arguments(values)
        return self.function(*args, **kwargs)

    def position(self, name: str) -> int:
        """Return the ABI position of the parameter ``name``.

        Raises:
            ValueError: the function has no such parameter.
        """
        try:
            return self._positions[name]
        except KeyError:
            raise ValueError(
                f"{self.api} function has no parameter named {name!r}; "
                f"parameters are {self.names!r}"
            ) from None

    def argnums(self, argnums: int | Iterable[int] | None) -> tuple[int, ...]:
        """Normalize ABI positions: accept one int or many, resolve negatives, sort.

        Raises:
            TypeError: an entry is not an integer.
            ValueError: an entry is outside the parameter list.
        """
        count = len(self.names)
        result: set[int] = set()
        for raw in _as_tuple(argnums, int):
            if isinstance(raw, bool):
                raise TypeError(f"{self.api} argnums must be integers, got {raw!r}")
            try:
                number = operator.index(raw)
            except TypeError:
                raise TypeError(f"{self.api} argnums must be integers, got {raw!r}") from None
            if not -count <= number < count:
                raise ValueError(
                    f"{self.api} argnum {number} is out of range for {count} parameters "
                    f"{self.names!r}"
                )
            result.add(number % count)
        return tuple(sorted(result))

    def argnames(self, argnames: str | Iterable[str] | None) -> tuple[str, ...]:
        """Normalize parameter names into declaration order, without duplicates.

        Raises:
            TypeError: an entry is not a string.
            ValueError: an entry names no parameter.
        """
        positions: set[int] = set()
        for name in _as_tuple(argnames, str):
            if not isinstance(name, str):
                raise TypeError(f"{self.api} argnames must be strings, got {name!r}")
            positions.add(self.position(name))
        return tuple(self.names[index] for index in sorted(positions))

    def names_of(self, argnums: int | Iterable[int] | None) -> tuple[str, ...]:
        """Map ABI positions to parameter names (declaration order)."""
        return tuple(self.names[index] for index in self.argnums(argnums))

    def argnums_of(self, argnames: str | Iterable[str] | None) -> tuple[int, ...]:
        """Map parameter names to ABI positions (sorted)."""
        return tuple(self.position(name) for name in self.argnames(argnames))

    def static(
        self,
        static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Reconcile jit-style static options into one consistent pair.

        A parameter marked static by position is static by name and vice versa, as
        ``jax.jit`` infers when given only one of the two options. The positions refer
        to the normalized ABI of :meth:`bind`, which is what a wrapper hands to the
        backend compiler.

        Returns:
            ``(argnums, argnames)`` naming the same parameters: sorted positions and
            names in declaration order.
        """
        positions = set(self.argnums(static_argnums)) | set(self.argnums_of(static_argnames))
        ordered = tuple(sorted(positions))
        return ordered, tuple(self.names[index] for index in ordered)

    def split(
        self, values: Sequence[Any], static_argnums: Iterable[int]
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Split an ABI tuple into ``(dynamic values, static values)``, each in order."""
        static = set(self.argnums(static_argnums))
        dynamic = tuple(value for index, value in enumerate(values) if index not in static)
        fixed = tuple(value for index, value in enumerate(values) if index in static)
        return dynamic, fixed
