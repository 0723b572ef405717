"""Numba kernels built on first use: the compiled passes of the probes, the batch and the
canonical Adam update, each with a pure numpy (or Torch) path where Numba is missing."""

from __future__ import annotations

import importlib
import os
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

_jit_lock = threading.Lock()


def jit(
    state: dict[str, Any],
    env: str,
    function: Any,
    trial: Callable[[Any], None],
    helpers: Mapping[str, frozenset[str]] | None = None,
    cache: bool = True,
    inline: frozenset[str] = frozenset(),
) -> Any:
    """``function`` compiled by Numba (``nogil``) on first use and kept in ``state``, or
    None: with ``env`` set to ``0``, without Numba, or when it cannot build or run it on
    the tiny input ``trial`` gives, so the caller takes its numpy or Torch path. The
    machine code is cached on disk where Numba finds a writable place (beside the
    module, else the user's cache): a process then loads it in milliseconds instead of
    compiling it for a second or two, which it did on the commit thread while the first
    training steps ran beside it.

    ``helpers`` names module-level functions ``function`` calls, each compiled with its
    own ``fastmath`` flags (Numba applies them to a whole function): the flags stay on
    the few lines whose arithmetic they cannot change. Numba's cache of a function is
    renewed when its own file changes, not when a helper's does: a ``function`` defined
    in another module than its helpers is built with ``cache=False``. The helpers named
    in ``inline`` are inlined where they are called, before compiling (a call between
    compiled functions costs every array passed its reference counting): only where the
    caller's ``fastmath`` flags are the helper's, which inlining would give it."""
    if os.environ.get(env, "1") == "0":
        return None
    with _jit_lock:
        if "kernel" not in state:
            state["kernel"] = _build(function, trial, helpers or {}, cache, inline)
    return state["kernel"]


def _build(
    function: Any,
    trial: Callable[[Any], None],
    helpers: Mapping[str, frozenset[str]],
    cache: bool,
    inline: frozenset[str],
) -> Any:
    try:
        numba = importlib.import_module("numba")

        def njit(py: Any, **options: Any) -> Any:
            try:
                return numba.njit(nogil=True, cache=cache, error_model="numpy", **options)(py)
            except RuntimeError:  # no writable cache location: compile in every process
                return numba.njit(nogil=True, cache=False, error_model="numpy", **options)(py)

        if helpers:
            # The function and its helpers see the helpers compiled: copies of them over
            # globals in which their names are bound to the compiled helpers (the modules
            # keep the Python ones), with the names of the helpers' own modules too.
            # Numba compiles on first call, once all are bound.
            names = dict(function.__globals__)
            for name in helpers:
                if name in function.__globals__:
                    for key, value in function.__globals__[name].__globals__.items():
                        names.setdefault(key, value)

            def over_names(py: Any) -> Any:
                return types.FunctionType(py.__code__, names, py.__name__, py.__defaults__)

            for name, fastmath in helpers.items():
                names[name] = njit(
                    over_names(names[name]),
                    fastmath=set(fastmath),
                    inline="always" if name in inline else "never",
                )
            function = over_names(function)
        kernel = njit(function)
        trial(kernel)
    except Exception:  # noqa: BLE001 - any failure to build means: the uncompiled path
        return None
    return kernel
