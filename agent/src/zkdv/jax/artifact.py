"""The attested JAX program artifact: what the transcript commits and a server replays.

``proof.jit`` exports the attested program with :mod:`jax.export` before the first step
and commits the exact bytes of this artifact (``Driver.runtime.set_program("jax.export", ...)``,
saved as ``<proof dir>/program.jaxexport``). It is a canonical-CBOR map::

    {
      "format": "zkdv.jax.export", "version": 1,
      "source": "zkdv.jax.contrib.TrainState" | "ZKDV.attest",
      "attest": <bytes: jax.export serialization>,      # (params, opt_state, batch, p, s)
      "transition": <bytes> | null,                    # (params, opt_state, batch)
      "params": [{"path", "dtype", "shape"}, ...],      # schema order = input order
      "opt_state": [{"path", "dtype", "shape"}, ...],
      "batch": {"rows", "cols", "leaves": [...], "keys": [...]},   # BatchLayout
      "jax": "<version>", "platforms": ["cpu", ...]
    }

Both programs take the states as *flat tuples of leaves in the transcript's schema
order* (the order of ``records.cborl``'s root schema and of the snapshot files), so a
replayer needs neither the training code nor its PyTree classes: ``attest`` maps
``(params, opt_state, uint32 batch, uint64 parameter index, uint64 optimizer-state
index)`` to two float scalars (the update and the post-update optimizer-state value at
those coordinates); ``transition`` maps ``(params, opt_state, batch)`` to
``(deltas, params_after, opt_state_after)``, each a tuple of leaves, and is what a
replay from a snapshot applies to the steps before the challenged one. The batch input
is the committed uint32 batch itself; the programs unpack it (``BatchLayout``).

:func:`register_serialization` registers Optax's state NamedTuples with
``jax.export.register_namedtuple_serialization``; call it in a writer and in a reader of
tree-structured exports. ZKDV's own artifact does not need it (its programs take flat
tuples), but applications exporting their own optimizer-state trees do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import jax
import numpy as np
from jax import export

from zkdv.jax._tree import BatchLayout

__all__ = [
    "FORMAT",
    "VERSION",
    "Artifact",
    "dumps",
    "register_namedtuple",
    "register_serialization",
]

FORMAT = "zkdv.jax.export"
VERSION = 1

_registered: set[type] = set()
_lock = threading.Lock()


def register_namedtuple(cls: type) -> None:
    """Register one NamedTuple type for ``jax.export`` serialization (idempotent)."""
    with _lock:
        if cls in _registered:
            return
        # A ValueError means it is registered elsewhere already: equally usable.
        with contextlib.suppress(ValueError):
            export.register_namedtuple_serialization(
                cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}"
            )
        _registered.add(cls)


def register_serialization() -> None:
    """Register every Optax optimizer-state NamedTuple for ``jax.export`` (idempotent).

    Must run in the process that serializes a tree-structured export and in the one
    that deserializes it (the server-side prover imports this module for that).
    """
    import optax

    seen: list[type] = []
    for module in (optax, getattr(optax, "contrib", None), getattr(optax, "schedules", None)):
        if module is None:
            continue
        for name in dir(module):
            value = getattr(module, name, None)
            if (
                isinstance(value, type)
                and issubclass(value, tuple)
                and hasattr(value, "_fields")
                and value.__module__.startswith("optax")
            ):
                seen.append(value)
    for cls in seen:
        register_namedtuple(cls)


def _specs(leaves: Sequence[Any], paths: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {"path": path, "dtype": str(np.dtype(leaf.dtype)), "shape": list(leaf.shape)}
        for path, leaf in zip(paths, leaves, strict=True)
    ]


def dumps(
    *,
    source: str,
    attest: export.Exported,
    transition: export.Exported | None,
    params: Sequence[tuple[str, Any]],
    opt_state: Sequence[tuple[str, Any]],
    layout: BatchLayout,
) -> bytes:
    """Encode the artifact (canonical CBOR); ``params``/``opt_state`` are ``(path, aval)``."""
    return bytes(
        cbor2.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "source": source,
                "attest": bytes(attest.serialize()),
                "transition": None if transition is None else bytes(transition.serialize()),
                "params": _specs([a for _, a in params], [p for p, _ in params]),
                "opt_state": _specs([a for _, a in opt_state], [p for p, _ in opt_state]),
                "batch": layout.to_dict(),
                "jax": jax.__version__,
                "platforms": list(attest.platforms),
            },
            canonical=True,
        )
    )


@dataclass
class Artifact:
    """A loaded artifact, ready to replay sampled checks."""

    source: str
    attest: export.Exported
    transition: export.Exported | None
    params: list[dict[str, Any]]
    opt_state: list[dict[str, Any]]
    layout: BatchLayout
    _calls: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def loads(cls, data: bytes | bytearray | memoryview) -> Artifact:
        """Decode an artifact written by :func:`dumps`.

        Raises:
            ValueError: not a ZKDV JAX artifact of a supported version.
        """
        envelope = cbor2.loads(bytes(data))
        if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
            raise ValueError("not a ZKDV JAX program artifact")
        if envelope.get("version") != VERSION:
            raise ValueError(f"unsupported ZKDV JAX artifact version {envelope.get('version')!r}")
        transition = envelope["transition"]
        return cls(
            source=str(envelope["source"]),
            attest=export.deserialize(bytearray(envelope["attest"])),
            transition=None if transition is None else export.deserialize(bytearray(transition)),
            params=list(envelope["params"]),
            opt_state=list(envelope["opt_state"]),
            layout=BatchLayout.from_dict(envelope["batch"]),
        )

    def _call(self, name: str) -> Any:
        call = self._calls.get(name)
        if call is None:
            program = self.attest if name == "attest" else self.transition
            assert program is not None
            call = jax.jit(program.call)
            self._calls[name] = call
        return call

    def step(self, params: Sequence[Any], opt_state: Sequence[Any], batch: Any) -> tuple[Any, Any]:
        """Apply one full transition; returns ``(params_after, opt_state_after)`` leaves.

        Raises:
            ValueError: the artifact has no transition program.
        """
        if self.transition is None:
            raise ValueError(
                "this artifact has no transition program; it can replay only a checked "
                "step that starts at a snapshot (replay_snapshot_interval=1)"
            )
        _, params_after, opt_after = self._call("transition")(
            tuple(params), tuple(opt_state), np.asarray(batch, dtype=np.uint32)
        )
        return list(params_after), list(opt_after)

    def check(
        self,
        params: Sequence[Any],
        opt_state: Sequence[Any],
        batch: Any,
        param_index: int,
        state_index: int,
    ) -> tuple[float, float]:
        """The attested (update, post-update optimizer-state) values at two coordinates."""
        with jax.enable_x64(True):
            delta, state = self._call("attest")(
                tuple(params),
                tuple(opt_state),
                np.asarray(batch, dtype=np.uint32),
                np.uint64(param_index),
                np.uint64(state_index),
            )
            # An explicit read: allowed where implicit device-to-host transfers are not.
            delta, state = jax.device_get((delta, state))
            return float(delta), float(state)

    def replay(
        self,
        params: Sequence[Any],
        opt_state: Sequence[Any],
        batches: Sequence[Any],
        param_index: int,
        state_index: int,
    ) -> tuple[float, float]:
        """Replay from a snapshot: every batch but the last is a full transition.

        Args:
            params: snapshot parameter leaves (schema order).
            opt_state: snapshot optimizer-state leaves (schema order).
            batches: committed batches from the snapshot step to the challenged step.
            param_index: challenged flat parameter index.
            state_index: challenged flat optimizer-state index.
        """
        params, opt_state = list(params), list(opt_state)
        for batch in batches[:-1]:
            params, opt_state = self.step(params, opt_state, batch)
        return self.check(params, opt_state, batches[-1], param_index, state_index)
