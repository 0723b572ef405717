"""The attested JAX program artifact: what the transcript commits and a server replays.

``proof.jit`` exports the attested program with :mod:`jax.export` before the first step
and commits the exact bytes of this artifact (``Driver.runtime.set_program("jax.export", ...)``,
saved as ``<proof dir>/program.jaxexport``).

Version 2: a run that commits its gradients
-------------------------------------------
A run that commits each step's computed values (:mod:`zkdv.gradients`; the gradient
the optimizer receives and the state the forward pass writes) trains with, and is
replayed with, one program: the *production* step itself. The artifact is::

    {
      "format": "zkdv.jax.export", "version": 2,
      "source": "zkdv.jax.contrib.TrainState" | "flax.nnx.Optimizer" | "zkdv.jax.Transaction"
                | "zkdv.jax.contrib.TrainState in zkdv.jax.scan",   # one update of the scan
      "production": <bytes>,   # (donated leaves, kept leaves, zero) -> flat outputs
      "apply": <bytes>,        # (params, opt_state, computed, zero) -> (params, opt_state)
      "inputs": {"count", "donated": [...], "kept": [...],        # input leaf positions
                 "params": [...], "opt_state": [...], "batch": [...]},
      "outputs": {"batch", "computed", "count"},                   # offsets
      "computed": [{"path", "dtype", "shape"}, ...],  # the root's schema.grad
      "optimizer": {"canonical": bool, "rules": "zkdv-jax-canonical-v2", "reason"?},
      "params": [...], "opt_state": [...], "batch": {...},   # as in version 1
      "jax": "<version>", "platforms": ["cpu", ...]
    }

``production`` is the training step's program over its flat input leaves: the leaves
at ``inputs.params`` and ``inputs.opt_state`` are the committed state in schema order,
those at ``inputs.batch`` the committed batch's unpacked inputs (``BatchLayout.unpack``),
grouped into the tuple the step donates and the one it keeps (the program itself
donates nothing); ``zero`` is a uint32 0. Its outputs are the packed batch, the
computed values (``computed``, in order) and the step's own results. ``apply`` is the
optimizer applied to computed values, canonically when ``optimizer.canonical``, with
the step counters incremented and the carried values written: the post-update state.
The training step runs the two programs one after the other, and so do the SDK's checks
and the platform's replay (:meth:`Artifact.compute`, :meth:`Artifact.apply`), so a
replay in the recorded environment reproduces every bit. The delta probes are of the
realized changes ``float32(after) - float32(before)``: where the step commits on the
host, of the probed rows, subtracted as :meth:`Artifact.apply` subtracts them.

Version 1: the attested function
--------------------------------
A run that commits no gradients (an explicit ``Transaction.update`` with
``proof.attest``, ``attest_apply_fn``), and every
transcript written before version 2, carries::

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
#: The version :func:`dumps` writes; :func:`dumps_committed` writes ``COMMITTED``.
VERSION = 1
COMMITTED = 2

#: XLA options of the committed apply program (the canonical update). Every operation
#: in it is fenced and exactly rounded (``zkdv.jax.canonical``), so no option changes a
#: bit of its results; most of its instructions are the fences' integer operations, and
#: XLA:CPU's default 256-bit vectors give them half of AVX-512's lanes. 512-bit vectors
#: took a step of ``bench/jax_overhead.py``'s 132 MiB MLP from 123-130 to 103-111 ms.
#: (On a CPU without AVX-512, or another backend, the option changes nothing.)
CANONICAL_OPTIONS = {"xla_cpu_prefer_vector_width": 512}

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


def dumps_committed(
    *,
    source: str,
    production: export.Exported,
    apply: export.Exported,
    inputs: dict[str, Any],
    outputs: dict[str, int],
    computed: Sequence[tuple[str, Any]],
    optimizer: dict[str, Any],
    params: Sequence[tuple[str, Any]],
    opt_state: Sequence[tuple[str, Any]],
    layout: BatchLayout,
) -> bytes:
    """Encode a version-2 artifact (module docstring); specs are ``(path, aval)``."""
    return bytes(
        cbor2.dumps(
            {
                "format": FORMAT,
                "version": COMMITTED,
                "source": source,
                "production": bytes(production.serialize()),
                "apply": bytes(apply.serialize()),
                "inputs": {key: value for key, value in inputs.items()},
                "outputs": dict(outputs),
                "computed": _specs([a for _, a in computed], [p for p, _ in computed]),
                "optimizer": dict(optimizer),
                "params": _specs([a for _, a in params], [p for p, _ in params]),
                "opt_state": _specs([a for _, a in opt_state], [p for p, _ in opt_state]),
                "batch": layout.to_dict(),
                "jax": jax.__version__,
                "platforms": list(production.platforms),
            },
            canonical=True,
        )
    )


def _selected(leaves: Sequence[Any], flat_index: int) -> float:
    """One coordinate of a tree by its flat index, read as ``zkdv.jax.index`` reads it."""
    arrays = [np.asarray(leaf) for leaf in leaves]
    cast = np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32
    offset = 0
    for array in arrays:
        if flat_index < offset + array.size:
            return float(cast(array.reshape(-1)[flat_index - offset]))
        offset += array.size
    return 0.0


def _strong(specs: Any) -> Any:
    """Input specs with weak types dropped: the exported programs fixed their meaning."""

    def strong(spec: Any) -> Any:
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype)  # type: ignore[no-untyped-call]

    return jax.tree.map(strong, specs)


@dataclass
class Artifact:
    """A loaded artifact, ready to replay sampled checks.

    A version-1 artifact has ``attest`` (and ``transition`` when it could be derived);
    a version-2 one ``production`` and ``apply`` (module docstring).
    """

    source: str
    attest: export.Exported | None
    transition: export.Exported | None
    params: list[dict[str, Any]]
    opt_state: list[dict[str, Any]]
    layout: BatchLayout
    version: int = VERSION
    production: export.Exported | None = None
    apply_program: export.Exported | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    computed: list[dict[str, Any]] = field(default_factory=list)
    optimizer: dict[str, Any] = field(default_factory=dict)
    #: The bytes it was loaded from (what the transcript commits).
    material: bytes = field(default=b"", repr=False)
    _calls: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def loads(cls, data: bytes | bytearray | memoryview) -> Artifact:
        """Decode an artifact written by :func:`dumps` or :func:`dumps_committed`.

        Raises:
            ValueError: not a ZKDV JAX artifact of a supported version.
        """
        envelope = cbor2.loads(bytes(data))
        if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
            raise ValueError("not a ZKDV JAX program artifact")
        version = envelope.get("version")
        common: dict[str, Any] = {
            "material": bytes(data),
            "source": str(envelope["source"]),
            "params": list(envelope["params"]),
            "opt_state": list(envelope["opt_state"]),
            "layout": BatchLayout.from_dict(envelope["batch"]),
        }
        if version == COMMITTED:
            return cls(
                attest=None,
                transition=None,
                version=COMMITTED,
                production=export.deserialize(bytearray(envelope["production"])),
                apply_program=export.deserialize(bytearray(envelope["apply"])),
                inputs=dict(envelope["inputs"]),
                outputs={str(k): int(v) for k, v in envelope["outputs"].items()},
                computed=list(envelope["computed"]),
                optimizer=dict(envelope["optimizer"]),
                **common,
            )
        if version != VERSION:
            raise ValueError(f"unsupported ZKDV JAX artifact version {version!r}")
        transition = envelope["transition"]
        return cls(
            attest=export.deserialize(bytearray(envelope["attest"])),
            transition=None if transition is None else export.deserialize(bytearray(transition)),
            **common,
        )

    @property
    def commits(self) -> bool:
        """Whether the run commits its gradients (a version-2 artifact)."""
        return self.version == COMMITTED

    @property
    def canonical(self) -> bool:
        """Whether ``apply`` is canonical: the same bits on any hardware."""
        return bool(self.optimizer.get("canonical", False))

    def _call(self, name: str) -> Any:
        call = self._calls.get(name)
        if call is None:
            if name == "production":
                assert self.production is not None
                # No donation: the apply program reads the parameters after it.
                call = jax.jit(self.production.call)
            elif name == "apply":
                assert self.apply_program is not None
                call = jax.jit(self.apply_program.call, compiler_options=CANONICAL_OPTIONS)
            elif name == "unpack":
                call = jax.jit(self.layout.unpack)
            else:
                program = self.attest if name == "attest" else self.transition
                assert program is not None
                call = jax.jit(program.call)
            self._calls[name] = call
        return call

    def compiled(self, name: str, *specs: Any) -> Any:
        """Compile ``production`` or ``apply`` for these input specs, once; later calls
        of this artifact (and the caller, with the result) run that executable.

        Weak types are dropped: the exported programs fixed their meaning already.
        """
        executable = self._call(name).lower(*_strong(specs)).compile()
        self._calls[name] = executable
        return executable

    def donating_apply(self, *specs: Any) -> Any:
        """``apply`` compiled for these input specs, donating its parameters (a tuple).

        For a training step that donates its parameters: XLA writes the post-update
        parameters into the pre-update ones' buffers, not into fresh memory. Not kept
        for this artifact's own calls: a check's replay reads its inputs again.
        """
        assert self.apply_program is not None
        call = jax.jit(
            self.apply_program.call, donate_argnums=(0,), compiler_options=CANONICAL_OPTIONS
        )
        return call.lower(*_strong(specs)).compile()

    def run(self, params: Sequence[Any], opt_state: Sequence[Any], batch: Any) -> list[Any]:
        """Run the production program on a committed state and batch (version 2).

        Returns:
            Its flat outputs (``outputs`` gives the offsets).
        """
        inputs = self.inputs
        leaves: list[Any] = [None] * int(inputs["count"])
        unpacked = self._call("unpack")(np.asarray(batch, dtype=np.uint32))
        for positions, values in (
            (inputs["params"], params),
            (inputs["opt_state"], opt_state),
            (inputs["batch"], unpacked),
        ):
            for position, value in zip(positions, values, strict=True):
                leaves[position] = value
        donated = tuple(leaves[i] for i in inputs["donated"])
        kept = tuple(leaves[i] for i in inputs["kept"])
        return list(self._call("production")(donated, kept, np.uint32(0)))

    def compute(self, params: Sequence[Any], opt_state: Sequence[Any], batch: Any) -> list[Any]:
        """The step's computed values (``schema.grad`` order), recomputed (version 2)."""
        outputs = self.run(params, opt_state, batch)
        start = self.outputs["computed"]
        return outputs[start : start + len(self.computed)]

    def apply(
        self, params: Sequence[Any], opt_state: Sequence[Any], computed: Sequence[Any]
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """The optimizer applied to computed values: ``(params, opt_state, deltas)``.

        Host arrays; ``deltas`` are the realized changes ``float32(after) -
        float32(before)`` (their probes are the step's delta probes: exact arithmetic,
        the same bits as the step's device-side subtraction, ``zkdv.probes``).
        """
        params_after, opt_after = self._call("apply")(
            tuple(params), tuple(opt_state), tuple(computed), np.uint32(0)
        )
        after = [np.asarray(a) for a in params_after]
        changes = [
            a.astype(np.float32) - np.asarray(b).astype(np.float32)
            for a, b in zip(after, params, strict=True)
        ]
        return after, [np.asarray(a) for a in opt_after], changes

    def step(self, params: Sequence[Any], opt_state: Sequence[Any], batch: Any) -> tuple[Any, Any]:
        """Apply one full transition; returns ``(params_after, opt_state_after)`` leaves.

        Raises:
            ValueError: the artifact has no transition program.
        """
        if self.commits:
            params_after, opt_after, _ = self.apply(
                params, opt_state, self.compute(params, opt_state, batch)
            )
            return params_after, opt_after
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
        """The attested (update, post-update optimizer-state) values at two coordinates.

        Version 2: the realized update ``float32(after) - float32(before)`` and the
        post-update optimizer-state value, after one step.
        """
        if self.commits:
            computed = self.compute(params, opt_state, batch)
            _, opt_after, deltas = self.apply(params, opt_state, computed)
            return _selected(deltas, param_index), _selected(opt_after, state_index)
        assert self.attest is not None
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
        params, opt_state = self.advance(params, opt_state, batches[:-1])
        return self.check(params, opt_state, batches[-1], param_index, state_index)

    def advance(
        self, params: Sequence[Any], opt_state: Sequence[Any], batches: Sequence[Any]
    ) -> tuple[Any, Any]:
        """Apply a full transition for each batch: the state after the last one."""
        for batch in batches:
            params, opt_state = self.step(params, opt_state, batch)
        return params, opt_state
