"""The offline transcript verifier: everything in the protocol that needs no replay.

It checks, in one streaming pass, and names the first problem with its record index and
field: the hash chain; every field of every record, its type and range, with no field
missing and none the protocol does not define; the root's configuration and schema;
every position the protocol fixes (steps in order; a snapshot of the pre-state of step
0 and of every ``snapshot_interval``-th step and none elsewhere; a check for exactly the
sampled steps, after the step, replaying from the snapshot that precedes it; probe
blocks back to back in ``probes.bin``); every sampling decision recomputed from the step
record's hash; snapshot roots continuing the committed state; probe continuity and
linearity within the run's tolerance; and the close record's counts and final roots.
``docs/transcript.md`` tabulates the rules with their reason codes and tests.

``python -m zkdv verify PROOF_DIR [--json]`` wraps :func:`verify_transcript`.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import IO, Any, NoReturn

import cbor2
import numpy as np

from zkdv.config import TOKEN_UNITS, ZKDVConfig
from zkdv.errors import TranscriptError
from zkdv.gradients import split_name
from zkdv.hashing import ZERO_DIGEST, Domain, hash_bytes, hasher
from zkdv.merkle import LeafSpec
from zkdv.probes import MAX_PROBE_ROWS, ProbeSet, probe_columns
from zkdv.records import (
    MAX_RECORD_BYTES,
    PROBES_FILE,
    PROTOCOL_VERSION,
    RECORDS_FILE,
    Record,
    iter_records,
)
from zkdv.sampling import Sampler

__all__ = ["VerificationReport", "verify_transcript"]

PROVERS = ("whitebox-jax", "whitebox-torch")
ROOTS = ("p", "o", "b")
_INF = math.inf

# The fields of every record and nested map: all of them required unless named optional
# (``records.py`` documents them). A field the protocol does not define is rejected too:
# it would be a free channel in a hashed record, and a verifier that ignored it could
# not say what it had checked.
ROOT_REQUIRED = frozenset(
    {
        "t",
        "v",
        "prev",
        "prover",
        "config",
        "program",
        "schema",
        "initial",
        "env",
        "experiment",
        "probe_seed",
        "created",
    }
)
CONFIG_FIELDS = frozenset(
    {
        "name",
        "sampling",
        "tolerance",
        "chunk_bytes",
        "rolling_window",
        "probe_ratio",
        "snapshot_interval",
        "max_in_flight",
    }
)
EVERY = frozenset({"kind", "n"})
BERNOULLI = frozenset({"kind", "p"})
#: ``token_unit``: what the steps' ``tokens`` count (zkdv.config.TOKEN_UNITS); a root
#: without it counts the committed batch's uint32 words (JAX) or its first integer
#: tensor's elements (Torch), as transcripts did before the unit was recorded.
CONFIG_ALLOWED = CONFIG_FIELDS | {"bounds", "token_unit"}
TOLERANCE = frozenset({"abs", "rel"})
BOUNDS = frozenset({"tensor", "total", "scale"})
SCHEMA_REQUIRED = frozenset({"params", "opt_state", "buffers", "batch"})
SCHEMA_ALLOWED = SCHEMA_REQUIRED | {"sharding", "grad"}
LEAF_FIELDS = frozenset({"path", "dtype", "shape"})
BATCH_SCHEMA = frozenset({"cols", "dtype"})
PROGRAM = frozenset({"kind", "digest", "bytes"})
EXPERIMENT_REQUIRED = frozenset({"name", "spec_digest"})
EXPERIMENT_ALLOWED = EXPERIMENT_REQUIRED | {"regime"}
STEP_REQUIRED = frozenset({"t", "i", "prev", "batch", "post", "probe", "tokens", "flops", "time"})
STEP_ALLOWED = STEP_REQUIRED | {"hp", "grad"}
BATCH_FIELDS = frozenset({"root", "rows", "cols", "win"})
PROBE_FIELDS = frozenset({"off", "len", "digest"})
CHECK_FIELDS = frozenset({"t", "i", "prev", "param", "state", "from", "replayed", "ok"})
OPENED = frozenset({"index", "committed", "replayed"})
SNAP_FIELDS = frozenset({"t", "i", "prev", "roots", "files"})
FILE_FIELDS = frozenset({"digest", "bytes"})
CLOSE_FIELDS = frozenset({"t", "prev", "steps", "checks", "final"})
ROOT_FIELDS = frozenset(ROOTS)
_RECORD_HASHER = hasher(Domain.RECORD)
#: Bounds of a step record's ``hp`` (per-step optimizer hyperparameters, Torch).
MAX_HP_GROUPS = 1024
MAX_HP_VALUES = 16


@dataclass
class VerificationReport:
    """What the verifier found. ``ok`` is False exactly when ``reason`` is set."""

    ok: bool = False
    reason: str | None = None
    message: str | None = None
    record: int | None = None
    field: str | None = None
    root: dict[str, Any] | None = None
    steps: int = 0
    checks: int = 0
    sampled: list[int] = dataclass_field(default_factory=list)
    snapshots: list[int] = dataclass_field(default_factory=list)
    tokens: int = 0
    flops: float = 0.0
    digest: str | None = None
    final: dict[str, str] | None = None
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "message": self.message,
            "record": self.record,
            "field": self.field,
            "root": _jsonable(self.root),
            "steps": self.steps,
            "checks": self.checks,
            "sampled": list(self.sampled),
            "snapshots": list(self.snapshots),
            "tokens": self.tokens,
            "flops": self.flops,
            "digest": self.digest,
            "final": self.final,
            "wall_seconds": self.wall_seconds,
        }

    def summary(self) -> str:
        if self.ok:
            return (
                f"valid: {self.steps} steps, {self.checks} sampled checks passed, "
                f"digest {self.digest}"
            )
        where = "" if self.record is None else f"record {self.record}: "
        return f"rejected ({self.reason}): {where}{self.message}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _fail(
    reason: str, message: str, record: int | None, field: str | None = None
) -> TranscriptError:
    return TranscriptError(reason, message, record=record, field=field)


def _require(
    data: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    record: int,
    prefix: str = "",
) -> Any:
    if key not in data:
        raise _fail("schema", f"missing field {prefix}{key!r}", record, prefix + key)
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise _fail(
            "schema",
            f"field {prefix}{key!r} must be {expected}, got {type(value).__name__}",
            record,
            prefix + key,
        )
    return value


def _digest(data: Mapping[str, Any], key: str, record: int, prefix: str = "") -> bytes:
    value = _require(data, key, bytes, record, prefix)
    if len(value) != 32:
        raise _fail(
            "schema",
            f"field {prefix}{key!r} must be a 32-byte digest, got {len(value)} bytes",
            record,
            prefix + key,
        )
    return bytes(value)


def _roots(data: Mapping[str, Any], key: str, record: int) -> tuple[bytes, bytes, bytes]:
    value = _require(data, key, dict, record)
    _keys(value, ROOT_FIELDS, ROOT_FIELDS, record, key, f"{key}.")
    return tuple(_digest(value, name, record, f"{key}.") for name in ROOTS)  # type: ignore[return-value]


def _specs(schema: Mapping[str, Any], key: str, record: int) -> tuple[LeafSpec, ...]:
    leaves = _require(schema, key, list, record, "schema.")
    specs = []
    for number, leaf in enumerate(leaves):
        if not (
            type(leaf) is dict
            and leaf.keys() == LEAF_FIELDS
            and isinstance(leaf["path"], str)
            and isinstance(leaf["dtype"], str)
            and type(leaf["shape"]) is list
            and all(type(d) is int and d >= 0 for d in leaf["shape"])
        ):
            raise _fail(
                "schema",
                f"schema.{key}[{number}] must be {{path, dtype, shape}}: text path and dtype, "
                "a list of non-negative integer dimensions",
                record,
                f"schema.{key}",
            )
        specs.append(LeafSpec(leaf["path"], leaf["dtype"], tuple(leaf["shape"])))
    return tuple(specs)


def _is_number(value: Any) -> bool:
    """An int or a finite float (never a bool: CBOR keeps them apart, so must we)."""
    kind = type(value)
    return kind is int or (kind is float and -_INF < value < _INF)


def _keys(
    data: Mapping[Any, Any],
    required: frozenset[str],
    allowed: frozenset[str],
    record: int,
    what: str,
    prefix: str = "",
) -> None:
    """Reject a map that lacks a required field or holds one the protocol does not define."""
    for key in sorted(required):
        if key not in data:
            raise _fail("schema", f"{what} is missing {key!r}", record, prefix + key)
    for key in data:
        if key not in allowed:
            raise _fail(
                "schema",
                f"{what} has a field the protocol does not define: {key!r}",
                record,
                f"{prefix}{key}",
            )


def _int(
    data: Mapping[str, Any], key: str, record: int, *, minimum: int = 0, prefix: str = ""
) -> int:
    value = data.get(key)
    if type(value) is not int:
        raise _fail(
            "schema",
            f"{prefix}{key} must be an integer, got {type(value).__name__}",
            record,
            prefix + key,
        )
    if value < minimum:
        raise _fail(
            "schema", f"{prefix}{key} must be at least {minimum}, got {value}", record, prefix + key
        )
    return value


def _number(data: Mapping[str, Any], key: str, record: int, *, prefix: str = "") -> float:
    value: Any = data.get(key)
    if not _is_number(value):
        raise _fail(
            "schema",
            f"{prefix}{key} must be a finite number, got {value!r:.40}",
            record,
            prefix + key,
        )
    return float(value)


def _probe_floats(specs: tuple[LeafSpec, ...], probe_ratio: float) -> int:
    """Floats in one probe of the parameters: what :attr:`ProbeSet.floats` computes,
    without drawing the probe matrices (a QR per leaf, too slow for the verifier)."""
    total = 0
    for spec in specs:
        if not spec.shape:
            rows, last = 1, 1
        else:
            last = spec.shape[-1]
            rows = spec.size // last if last else 0
        total += min(rows, MAX_PROBE_ROWS) * min(probe_columns(max(last, 1), probe_ratio), last)
    return total


def _hp_groups(env: Mapping[str, Any]) -> tuple[frozenset[Any], ...] | None:
    """The option keys of each optimizer group the root records, if it records a list."""
    optimizer = env.get("optimizer")
    groups = optimizer.get("groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return None
    return tuple(frozenset(group) if isinstance(group, dict) else frozenset() for group in groups)


def _buffer(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
) -> memoryview:
    """The transcript's bytes, from any source :func:`iter_records` reads."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return memoryview(source)
    if hasattr(source, "read"):
        return memoryview(source.read())
    path = Path(source)
    if path.is_dir():
        path = path / RECORDS_FILE
    return memoryview(path.read_bytes())


def _frames(view: memoryview) -> Iterator[tuple[int, int, bytes, dict[str, Any]]]:
    """``(offset, end, hash, record)`` of each record: :func:`iter_records`, less its
    object per record (and measurably faster than decoding inline in the verifier's
    loop). A record the reader would refuse gets the reader's own precise error."""
    total = len(view)
    stream = io.BytesIO(view)
    decode = cbor2.CBORDecoder(stream).decode
    tell = stream.tell
    new_hash = _RECORD_HASHER.copy
    offset = 0
    while offset < total:
        try:
            data = decode()
        except Exception:  # noqa: BLE001 - the reader names the failure precisely
            _reader_error(view)
        end = tell()
        if type(data) is not dict or end - offset > MAX_RECORD_BYTES:
            _reader_error(view)
        hasher = new_hash()
        hasher.update(view[offset:end])
        yield offset, end, hasher.digest(), data
        offset = end


def _reader_error(view: memoryview) -> NoReturn:
    """Raise the error :func:`iter_records` gives for the first record it refuses."""
    for _ in iter_records(view):
        pass
    raise TranscriptError("malformed_record", "the transcript's framing is malformed")


class _Verifier:
    def __init__(self, probes_path: Path | None) -> None:
        self.report = VerificationReport()
        self.index = -1
        self.probes_path = probes_path
        self._probe_data: np.ndarray | None = None

    # --- root ---------------------------------------------------------------------------
    def root(self, record: Record) -> None:
        data, index = record.data, record.index
        if data.get("t") != "root":
            raise _fail(
                "missing_root",
                f"the first record must be the root, got {data.get('t')!r:.40}",
                index,
                "t",
            )
        if type(data.get("v")) is not int or data["v"] != PROTOCOL_VERSION:
            raise _fail(
                "version",
                f"protocol version {data.get('v')!r:.40} is not supported (expected {PROTOCOL_VERSION})",
                index,
                "v",
            )
        _keys(data, ROOT_REQUIRED, ROOT_REQUIRED, index, "the root record")
        if _digest(data, "prev", index) != ZERO_DIGEST:
            raise _fail(
                "broken_chain", "the root record's prev must be 32 zero bytes", index, "prev"
            )
        if data["prover"] not in PROVERS:
            raise _fail(
                "schema",
                f"unknown prover {data['prover']!r:.60}; expected one of {', '.join(PROVERS)}",
                index,
                "prover",
            )
        self._config(_require(data, "config", dict, index), index)
        schema = _require(data, "schema", dict, index)
        _keys(schema, SCHEMA_REQUIRED, SCHEMA_ALLOWED, index, "schema", "schema.")
        self.param_specs = _specs(schema, "params", index)
        self.state_specs = _specs(schema, "opt_state", index)
        buffer_specs = _specs(schema, "buffers", index)
        self.grad = self._grad_schema(
            schema,
            config_bounds=self._bounds,
            trees=(self.param_specs, self.state_specs, buffer_specs),
            index=index,
        )
        batch = _require(schema, "batch", dict, index)
        _keys(batch, BATCH_SCHEMA, BATCH_SCHEMA, index, "schema.batch", "schema.batch.")
        self.batch_cols = _int(batch, "cols", index, minimum=1, prefix="schema.batch.")
        if batch["dtype"] != "uint32":
            raise _fail(
                "schema",
                f"schema.batch.dtype must be 'uint32', got {batch['dtype']!r:.40}",
                index,
                "schema.batch.dtype",
            )
        if self.rolling_window > self.batch_cols:
            raise _fail(
                "schema",
                f"rolling_window {self.rolling_window} must be between 1 and the batch row width {self.batch_cols}",
                index,
                "config.rolling_window",
            )
        self._program(data["program"], index)
        self.post = _roots(data, "initial", index)
        env = _require(data, "env", dict, index)
        self.hp_groups = _hp_groups(env)
        self._experiment(data["experiment"], index)
        seed = _require(data, "probe_seed", bytes, index)
        if len(seed) != 16:
            raise _fail(
                "schema", f"probe_seed must be 16 bytes, got {len(seed)}", index, "probe_seed"
            )
        self.probe_seed = bytes(seed)
        _number(data, "created", index)
        self.param_count = sum(spec.size for spec in self.param_specs)
        self.state_count = sum(spec.size for spec in self.state_specs)
        self.sampler = Sampler(
            self.config.sampling_policy, param_count=self.param_count, state_count=self.state_count
        )
        # Every step's probe block has this length, and starts where the last one ended:
        # pre, post and delta probes, and the gradient's when the run commits it.
        self.probe_parts = 4 if self.grad else 3
        self.probe_bytes = self.probe_parts * 4 * _probe_floats(self.param_specs, self.probe_ratio)
        # A step record's field count: nine, plus its computed values' root, plus hp.
        self.step_fields = 10 if self.grad else 9
        self.probe_end = 0
        self.report.root = data
        self.pending: dict[int, Any] = {}
        self.next_step = 0
        # The next step whose pre-state the interval puts a snapshot before, and the
        # latest snapshot recorded (step, record index).
        self.snapshot_due = 0
        self.last_snapshot = -1
        self.last_snapshot_record = -1
        self.last_probe: np.ndarray | None = None
        self.probe_set: ProbeSet | None = None

    def _config(self, config: Mapping[str, Any], index: int) -> None:
        _keys(config, CONFIG_FIELDS, CONFIG_ALLOWED, index, "config", "config.")
        self._bounds = "bounds" in config
        if self._bounds:
            bounds = _require(config, "bounds", dict, index, "config.")
            _keys(bounds, BOUNDS, BOUNDS, index, "config.bounds", "config.bounds.")
            for key in sorted(BOUNDS):
                if not 0.0 <= _number(bounds, key, index, prefix="config.bounds.") < 1.0:
                    raise _fail(
                        "schema",
                        f"config.bounds.{key} must be in [0, 1)",
                        index,
                        f"config.bounds.{key}",
                    )
        unit = config.get("token_unit", TOKEN_UNITS[0])
        if unit not in TOKEN_UNITS:
            raise _fail(
                "schema",
                f"config.token_unit must be one of {', '.join(map(repr, TOKEN_UNITS))}, "
                f"got {unit!r:.40}",
                index,
                "config.token_unit",
            )
        name = config["name"]
        if not isinstance(name, str) or not name:
            raise _fail("schema", "config.name must be a non-empty string", index, "config.name")
        sampling = _require(config, "sampling", dict, index)
        kind = sampling.get("kind")
        if kind == "every":
            _keys(sampling, EVERY, EVERY, index, "config.sampling", "config.sampling.")
            _int(sampling, "n", index, minimum=1, prefix="config.sampling.")
        elif kind == "bernoulli":
            _keys(sampling, BERNOULLI, BERNOULLI, index, "config.sampling", "config.sampling.")
            if not 0.0 <= _number(sampling, "p", index, prefix="config.sampling.") <= 1.0:
                raise _fail(
                    "schema",
                    "config.sampling.p must be a probability in [0, 1]",
                    index,
                    "config.sampling.p",
                )
        else:
            raise _fail(
                "schema",
                f"config.sampling.kind must be 'every' or 'bernoulli', got {kind!r:.40}",
                index,
                "config.sampling.kind",
            )
        tolerance = _require(config, "tolerance", dict, index)
        _keys(tolerance, TOLERANCE, TOLERANCE, index, "config.tolerance", "config.tolerance.")
        for key in sorted(TOLERANCE):
            if _number(tolerance, key, index, prefix="config.tolerance.") < 0:
                raise _fail(
                    "schema",
                    f"config.tolerance.{key} must not be negative",
                    index,
                    f"config.tolerance.{key}",
                )
        chunk = _int(config, "chunk_bytes", index, minimum=64, prefix="config.")
        if chunk & (chunk - 1):
            raise _fail(
                "schema",
                f"config.chunk_bytes {chunk} must be a power of two",
                index,
                "config.chunk_bytes",
            )
        self.rolling_window = _int(config, "rolling_window", index, minimum=1, prefix="config.")
        self.probe_ratio = _number(config, "probe_ratio", index, prefix="config.")
        if not 0.0 < self.probe_ratio <= 1.0:
            raise _fail(
                "schema", "config.probe_ratio must be in (0, 1]", index, "config.probe_ratio"
            )
        self.snapshot_interval = _int(
            config, "snapshot_interval", index, minimum=1, prefix="config."
        )
        _int(config, "max_in_flight", index, minimum=1, prefix="config.")
        self.config = ZKDVConfig.from_dict(dict(config))

    @staticmethod
    def _grad_schema(
        schema: Mapping[str, Any],
        *,
        config_bounds: bool,
        trees: tuple[tuple[LeafSpec, ...], ...],
        index: int,
    ) -> bool:
        """Whether the run commits computed values (``schema.grad``, ``config.bounds``).

        Each computed leaf names a leaf of the parameters (its gradient) or of the
        optimizer state or buffers (a value the forward pass computes), with that leaf's
        dtype and shape, at most once.
        """
        if "grad" not in schema:
            if config_bounds:
                raise _fail(
                    "schema",
                    "config.bounds is given but the schema commits no computed values (schema.grad)",
                    index,
                    "config.bounds",
                )
            return False
        if not config_bounds:
            raise _fail(
                "schema",
                "schema.grad commits computed values but config.bounds does not bound them",
                index,
                "config",
            )
        known = {
            name: {spec.path: spec for spec in specs}
            for name, specs in zip(("params", "opt_state", "buffers"), trees, strict=True)
        }
        seen: set[str] = set()
        for number, spec in enumerate(_specs(schema, "grad", index)):
            try:
                tree, path = split_name(spec.path)
            except ValueError as error:
                raise _fail(
                    "schema", f"schema.grad[{number}]: {error}", index, "schema.grad"
                ) from None
            target = known[tree].get(path)
            if target is None or (target.dtype, target.shape) != (spec.dtype, spec.shape):
                raise _fail(
                    "schema",
                    f"schema.grad[{number}] {spec.path!r:.80} does not name a {tree} leaf of "
                    "the same dtype and shape",
                    index,
                    "schema.grad",
                )
            if spec.path in seen:
                raise _fail(
                    "schema", f"schema.grad names {spec.path!r:.80} twice", index, "schema.grad"
                )
            seen.add(spec.path)
        return True

    @staticmethod
    def _program(program: Any, index: int) -> None:
        if program is None:
            return
        if not isinstance(program, dict):
            raise _fail("schema", "program must be {kind, digest, bytes} or null", index, "program")
        _keys(program, PROGRAM, PROGRAM, index, "program", "program.")
        if not isinstance(program["kind"], str) or not program["kind"]:
            raise _fail("schema", "program.kind must be a non-empty string", index, "program.kind")
        _digest(program, "digest", index)
        _int(program, "bytes", index, prefix="program.")

    @staticmethod
    def _experiment(experiment: Any, index: int) -> None:
        if experiment is None:
            return
        if not isinstance(experiment, dict):
            raise _fail(
                "schema", "experiment must be {name, spec_digest} or null", index, "experiment"
            )
        _keys(
            experiment, EXPERIMENT_REQUIRED, EXPERIMENT_ALLOWED, index, "experiment", "experiment."
        )
        for key in sorted(experiment):
            if not isinstance(experiment[key], str):
                raise _fail(
                    "schema", f"experiment.{key} must be a string", index, f"experiment.{key}"
                )

    # --- the record loop --------------------------------------------------------------
    def run(self, view: memoryview, on_progress: Callable[[int], None] | None) -> bytes:
        """Verify every record in ``view``; returns the transcript digest.

        A well-formed step record is checked inline: plain lookups and identity type
        checks, every one a rule of the protocol. Anything unusual falls through to the
        precise validation in :meth:`_step_checked`, which names the offending field.
        """
        report = self.report
        index = 0
        prev = ZERO_DIGEST
        closed = False
        for offset, end, digest, data in _frames(view):
            self.index = index
            if on_progress is not None and not index % PROGRESS_RECORDS:
                on_progress(offset)
            if closed:
                raise _fail("after_close", "records follow the close record", index)
            if not index:
                self.root(Record(index, offset, end - offset, digest, data))
            else:
                if data.get("prev") != prev:
                    raise _fail(
                        "broken_chain",
                        "prev does not match the hash of the previous record (an edited, dropped or reordered record)",
                        index,
                        "prev",
                    )
                kind = data.get("t")
                if kind == "step":
                    try:
                        step = data["i"]
                        batch, post, probe, tokens, flops, times = (
                            data["batch"],
                            data["post"],
                            data["probe"],
                            data["tokens"],
                            data["flops"],
                            data["time"],
                        )
                        rows, cols = batch["rows"], batch["cols"]
                        broot, win = batch["root"], batch["win"]
                        roots = (post["p"], post["o"], post["b"])
                        start, finish = times
                        fast = (
                            type(step) is int
                            and step == self.next_step
                            and (step != self.snapshot_due or self.last_snapshot == step)
                            and (
                                len(data) == self.step_fields
                                or (len(data) == self.step_fields + 1 and "hp" in data)
                            )
                            and (
                                not self.grad
                                or (type(data["grad"]) is bytes and len(data["grad"]) == 32)
                            )
                            and len(batch) == 4
                            and len(post) == 3
                            and type(broot) is bytes
                            and len(broot) == 32
                            and type(win) is bytes
                            and len(win) == 32
                            and type(cols) is int
                            and cols == self.batch_cols
                            and type(rows) is int
                            and rows >= 1
                            and type(roots[0]) is bytes
                            and type(roots[1]) is bytes
                            and type(roots[2]) is bytes
                            and len(roots[0]) == len(roots[1]) == len(roots[2]) == 32
                            and type(tokens) is int
                            and tokens >= 0
                            and (flops is None or (type(flops) is float and 0.0 <= flops < _INF))
                            and type(times) is list
                            and type(start) is float
                            and type(finish) is float
                            and -_INF < start < _INF
                            and -_INF < finish < _INF
                        )
                    except (KeyError, TypeError, ValueError):
                        fast = False
                    if not fast:
                        self._step_checked(Record(index, offset, end - offset, digest, data))
                    else:
                        if probe is not None:
                            self._probe(step, probe, index)
                        if len(data) > self.step_fields:
                            self._hp(step, data["hp"], index)
                        report.tokens += tokens
                        if flops is not None:
                            report.flops += flops
                        # _advance, inlined: this runs for every step record.
                        challenge = self.sampler.decide(step, digest)
                        if challenge is not None:
                            self.pending[step] = challenge
                            report.sampled.append(step)
                        if step == self.snapshot_due:
                            self.snapshot_due += self.snapshot_interval
                        self.post = roots
                        self.next_step = step + 1
                        report.steps += 1
                elif kind == "check":
                    self.check(Record(index, offset, end - offset, digest, data))
                elif kind == "snap":
                    # The common snapshot, inline: where the interval puts it, no files
                    # listed, roots equal to the committed ones (which are 32-byte
                    # digests, so equal ones are too). Anything else: snapshot().
                    step, roots_map = data.get("i"), data.get("roots")
                    if (
                        type(step) is int
                        and step == self.next_step
                        and step == self.snapshot_due
                        and step != self.last_snapshot
                        and len(data) == 5
                        and data.get("files") == {}
                        and type(roots_map) is dict
                        and len(roots_map) == 3
                        and (roots_map.get("p"), roots_map.get("o"), roots_map.get("b"))
                        == self.post
                    ):
                        self.last_snapshot = step
                        self.last_snapshot_record = index
                        report.snapshots.append(step)
                    else:
                        self.snapshot(Record(index, offset, end - offset, digest, data))
                elif kind == "close":
                    self.close(Record(index, offset, end - offset, digest, data))
                    closed = True
                else:
                    raise _fail("schema", f"unknown record type {kind!r:.40}", index, "t")
            prev = digest
            index += 1
        if not index:
            raise _fail("empty", "the transcript holds no records", None)
        if not closed:
            raise _fail(
                "missing_close",
                f"the transcript ends after record {index - 1} without a close record (the run was not closed)",
                index,
            )
        return prev

    def _advance(self, step: int, digest: bytes, roots: tuple[bytes, bytes, bytes]) -> None:
        challenge = self.sampler.decide(step, digest)
        if challenge is not None:
            self.pending[step] = challenge
            self.report.sampled.append(step)
        if step == self.snapshot_due:
            self.snapshot_due += self.snapshot_interval
        self.post = roots
        self.next_step = step + 1
        self.report.steps += 1

    def _step_checked(self, record: Record) -> None:
        data, index = record.data, record.index
        step = _require(data, "i", int, index)
        if step != self.next_step:
            kind = "duplicated" if step < self.next_step else "missing or reordered"
            raise _fail(
                "step_order",
                f"expected step {self.next_step}, found step {step} ({kind} step record)",
                index,
                "i",
            )
        if step == self.snapshot_due and self.last_snapshot != step:
            raise _fail(
                "missing_snapshot",
                f"step {step} has no snapshot record of its pre-state: snapshot_interval "
                f"{self.snapshot_interval} puts one before step {step}'s record",
                index,
                "i",
            )
        for key in ("program", "config"):
            if key in data:
                raise _fail(
                    "program_changed",
                    f"step {step} changes the {key} fixed by the root record",
                    index,
                    key,
                )
        _keys(data, STEP_REQUIRED, STEP_ALLOWED, index, f"step record {step}")
        if self.grad:
            _digest(data, "grad", index)
        elif "grad" in data:
            raise _fail(
                "schema",
                f"step record {step} commits computed values (grad) but the root's schema does not",
                index,
                "grad",
            )
        batch = _require(data, "batch", dict, index)
        _keys(batch, BATCH_FIELDS, BATCH_FIELDS, index, "batch", "batch.")
        _digest(batch, "root", index, "batch.")
        _digest(batch, "win", index, "batch.")
        cols = _int(batch, "cols", index, prefix="batch.")
        if cols != self.batch_cols:
            raise _fail(
                "batch_shape",
                f"step {step} commits a batch of {cols} columns; the schema fixes {self.batch_cols}",
                index,
                "batch.cols",
            )
        if _int(batch, "rows", index, prefix="batch.") < 1:
            raise _fail("batch_shape", f"step {step} commits an empty batch", index, "batch.rows")
        post = _roots(data, "post", index)
        tokens = _int(data, "tokens", index)
        flops = data["flops"]
        if flops is not None and (not _is_number(flops) or flops < 0):
            raise _fail(
                "schema", "flops must be a finite non-negative number or null", index, "flops"
            )
        times = data["time"]
        if not (type(times) is list and len(times) == 2 and all(_is_number(t) for t in times)):
            raise _fail("schema", "time must be [start, end], two finite numbers", index, "time")
        probe = data["probe"]
        if probe is not None:
            self._probe(step, probe, index)
        if "hp" in data:
            self._hp(step, data["hp"], index)
        self.report.tokens += tokens
        if flops is not None:
            self.report.flops += float(flops)
        self._advance(step, record.hash, post)

    def _probe(self, step: int, probe: Any, index: int) -> None:
        """The probe reference: where the protocol puts it in ``probes.bin``, then its bytes."""
        if type(probe) is not dict:
            raise _fail("schema", "probe must be {off, len, digest} or null", index, "probe")
        _keys(probe, PROBE_FIELDS, PROBE_FIELDS, index, "probe", "probe.")
        offset = _int(probe, "off", index, prefix="probe.")
        length = _int(probe, "len", index, prefix="probe.")
        _digest(probe, "digest", index, "probe.")
        if offset != self.probe_end or length != self.probe_bytes:
            raise _fail(
                "probe_range",
                f"step {step} probe range {offset}+{length} is not where the protocol puts it: "
                f"{self.probe_end}+{self.probe_bytes} (probe blocks follow one another in "
                f"{PROBES_FILE}, each {self.probe_parts} x 4 x "
                f"{self.probe_bytes // (4 * self.probe_parts)} bytes for this schema)",
                index,
                "probe.off" if offset != self.probe_end else "probe.len",
            )
        self.probe_end = offset + length
        if self.probes_path is not None:
            self._check_probes(step, probe, index)

    def _hp(self, step: int, hp: Any, index: int) -> None:
        """Per-step optimizer hyperparameters: one map per parameter group (Torch)."""
        if type(hp) is not list or len(hp) > MAX_HP_GROUPS:
            raise _fail(
                "schema",
                f"step {step} hp must be a list of at most {MAX_HP_GROUPS} maps, one per optimizer group",
                index,
                "hp",
            )
        groups = self.hp_groups
        if groups is not None and len(hp) != len(groups):
            raise _fail(
                "schema",
                f"step {step} hp has {len(hp)} groups; the root's env.optimizer.groups records {len(groups)}",
                index,
                "hp",
            )
        for group, options in enumerate(hp):
            if type(options) is not dict:
                raise _fail("schema", f"step {step} hp group {group} must be a map", index, "hp")
            for key, value in options.items():
                if type(key) is not str:
                    raise _fail(
                        "schema",
                        f"step {step} hp group {group}: option name {key!r:.40} is not text",
                        index,
                        "hp",
                    )
                if groups is not None and key not in groups[group]:
                    raise _fail(
                        "schema",
                        f"step {step} hp group {group}: option {key!r:.60} is not among the "
                        f"options env.optimizer.groups[{group}] records",
                        index,
                        "hp",
                    )
                if _is_number(value):
                    continue
                if (
                    type(value) is list
                    and len(value) <= MAX_HP_VALUES
                    and all(_is_number(v) for v in value)
                ):
                    continue
                raise _fail(
                    "schema",
                    f"step {step} hp group {group}: option {key!r:.60} must be a finite number "
                    f"or a list of at most {MAX_HP_VALUES} finite numbers",
                    index,
                    "hp",
                )

    def _check_probes(self, step: int, probe: Mapping[str, Any], index: int) -> None:
        if self._probe_data is None:
            path = self.probes_path
            assert path is not None
            if not path.exists():
                raise _fail(
                    "probe_missing",
                    f"step {step} references probes but {PROBES_FILE} is absent",
                    index,
                    "probe",
                )
            self._probe_raw = path.read_bytes()
            self._probe_data = np.frombuffer(self._probe_raw, dtype="<f4")
            self.probe_set = ProbeSet.create(self.param_specs, self.probe_ratio, self.probe_seed)
        offset, length = probe["off"], probe["len"]
        if offset + length > len(self._probe_raw):
            raise _fail(
                "probe_missing",
                f"step {step} probe range {offset}+{length} is outside {PROBES_FILE} ({len(self._probe_raw)} bytes)",
                index,
                "probe",
            )
        raw = self._probe_raw[offset : offset + length]
        if hash_bytes(Domain.PROBE, raw) != probe["digest"]:
            raise _fail(
                "probe_digest",
                f"step {step} probe bytes do not match their committed digest",
                index,
                "probe.digest",
            )
        values = np.frombuffer(raw, dtype="<f4").reshape(self.probe_parts, -1)
        pre, post, delta = values[:3]
        tol = self.config.tolerance
        self._compare(step, "probe: post != pre + delta", post, pre + delta, tol, index)
        if self.last_probe is not None:
            self._compare(
                step,
                f"probe: pre-update parameters of step {step} do not continue the post-update parameters of step {step - 1}",
                pre,
                self.last_probe,
                tol,
                index,
            )
        self.last_probe = post

    @staticmethod
    def _compare(
        step: int, what: str, got: np.ndarray, want: np.ndarray, tol: Any, index: int
    ) -> None:
        bound = tol.absolute + tol.relative * np.abs(want)
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bad = ~(diff <= bound)
        if bad.any():
            worst = int(np.argmax(np.where(bad, diff - bound, -np.inf)))
            raise _fail(
                "probe_discontinuity",
                f"{what}: coordinate {worst} differs by {diff[worst]:.3g} (tolerance {bound[worst]:.3g})",
                index,
                "probe",
            )

    # --- checks, snapshots, close -------------------------------------------------------
    def check(self, record: Record) -> None:
        data, index = record.data, record.index
        step = _require(data, "i", int, index)
        challenge = self.pending.pop(step, None)
        if challenge is None:
            if step >= self.next_step:
                raise _fail(
                    "check_order", f"check for step {step} precedes that step's record", index, "i"
                )
            raise _fail(
                "unexpected_check",
                f"step {step} was not sampled (or was already checked); its check record is forged or duplicated",
                index,
                "i",
            )
        _keys(data, CHECK_FIELDS, CHECK_FIELDS, index, f"check record of step {step}")
        param = _require(data, "param", dict, index)
        state = _require(data, "state", dict, index)
        _keys(param, OPENED, OPENED, index, "param", "param.")
        _keys(state, OPENED, OPENED, index, "state", "state.")
        if _int(param, "index", index, prefix="param.") != challenge.param_index:
            raise _fail(
                "altered_check",
                f"check of step {step} opened parameter {param['index']}, the transcript sampled {challenge.param_index}",
                index,
                "param.index",
            )
        if _int(state, "index", index, prefix="state.") != challenge.state_index:
            raise _fail(
                "altered_check",
                f"check of step {step} opened optimizer-state coordinate {state['index']}, the transcript sampled {challenge.state_index}",
                index,
                "state.index",
            )
        # A check replays from the snapshot that precedes its step: the latest multiple
        # of the interval, through every step after it.
        start = step - step % self.snapshot_interval
        if _int(data, "from", index) != start:
            raise _fail(
                "altered_check",
                f"check of step {step} replays from step {data['from']}; the snapshot it must "
                f"start from is step {start} (snapshot_interval {self.snapshot_interval})",
                index,
                "from",
            )
        if _int(data, "replayed", index) != step - start:
            raise _fail(
                "altered_check",
                f"check of step {step} says it replayed {data['replayed']} steps before the "
                f"checked one; from step {start} that is {step - start}",
                index,
                "replayed",
            )
        tol = self.config.tolerance
        verdicts = []
        for name, values in (("param", param), ("state", state)):
            committed, replayed = values["committed"], values["replayed"]
            for key, value in (("committed", committed), ("replayed", replayed)):
                if type(value) is not float and type(value) is not int:
                    raise _fail(
                        "schema",
                        f"{name}.{key} must be a number, got {type(value).__name__}",
                        index,
                        f"{name}.{key}",
                    )
            verdicts.append(
                (name, committed, replayed, tol.close(float(replayed), float(committed)))
            )
        ok = _require(data, "ok", bool, index)
        recomputed = all(v[3] for v in verdicts)
        if ok != recomputed:
            raise _fail(
                "altered_check",
                f"check of step {step} claims ok={ok} but its values give ok={recomputed}",
                index,
                "ok",
            )
        if not ok:
            name, committed, replayed, _ = next(v for v in verdicts if not v[3])
            raise _fail(
                "failed_check",
                f"sampled check of step {step} failed: {name} committed {committed!r}, replayed {replayed!r} (tolerance abs {tol.absolute:g}, rel {tol.relative:g})",
                index,
                name,
            )
        self.report.checks += 1

    def snapshot(self, record: Record) -> None:
        data, index = record.data, record.index
        step = _require(data, "i", int, index)
        if step != self.next_step:
            raise _fail(
                "snapshot_order",
                f"snapshot of the pre-state of step {step} recorded before step {self.next_step}",
                index,
                "i",
            )
        if self.last_snapshot == step:
            raise _fail("snapshot_order", f"snapshot of step {step} is recorded twice", index, "i")
        if step != self.snapshot_due:
            raise _fail(
                "unexpected_snapshot",
                f"snapshot of the pre-state of step {step}, which snapshot_interval "
                f"{self.snapshot_interval} does not name (snapshots precede steps 0, "
                f"{self.snapshot_interval}, {2 * self.snapshot_interval}, ...)",
                index,
                "i",
            )
        _keys(data, SNAP_FIELDS, SNAP_FIELDS, index, f"snapshot record of step {step}")
        self._continues(
            _roots(data, "roots", index),
            "roots",
            f"snapshot roots of step {step} do not continue the committed state",
            index,
        )
        files = _require(data, "files", dict, index)
        for name, entry in files.items():
            if not isinstance(name, str) or not isinstance(entry, dict):
                raise _fail(
                    "schema", f"snapshot file entry {name!r:.60} is malformed", index, "files"
                )
            _keys(
                entry,
                FILE_FIELDS,
                FILE_FIELDS,
                index,
                f"snapshot file entry {name!r:.60}",
                "files.",
            )
            _digest(entry, "digest", index, "files.")
            _int(entry, "bytes", index, prefix="files.")
        self.last_snapshot = step
        self.last_snapshot_record = index
        self.report.snapshots.append(step)

    def _continues(self, roots: tuple[bytes, ...], field: str, message: str, index: int) -> None:
        """Reject ``roots`` unless they equal the last committed post-update roots."""
        if roots != self.post:
            which = next(n for n, a, b in zip(ROOTS, roots, self.post, strict=True) if a != b)
            raise _fail(
                "state_discontinuity",
                f"{message} (root {which!r} differs)",
                index,
                f"{field}.{which}",
            )

    def close(self, record: Record) -> None:
        data, index = record.data, record.index
        if self.last_snapshot == self.next_step:
            # Recorded just before a step record that never came: an honest writer
            # records a snapshot only together with its step.
            raise _fail(
                "unexpected_snapshot",
                f"snapshot of the pre-state of step {self.last_snapshot}, but the run ends "
                f"after {self.next_step} steps",
                self.last_snapshot_record,
                "i",
            )
        if self.pending:
            step = min(self.pending)
            raise _fail(
                "missing_check",
                f"step {step} was sampled but has no check record (a skipped check)",
                index,
            )
        _keys(data, CLOSE_FIELDS, CLOSE_FIELDS, index, "the close record")
        steps = _int(data, "steps", index)
        if steps != self.report.steps:
            raise _fail(
                "count_mismatch",
                f"close record counts {steps} steps, the transcript has {self.report.steps}",
                index,
                "steps",
            )
        checks = _int(data, "checks", index)
        if checks != self.report.checks:
            raise _fail(
                "count_mismatch",
                f"close record counts {checks} checks, the transcript has {self.report.checks}",
                index,
                "checks",
            )
        final = _roots(data, "final", index)
        self._continues(
            final, "final", "final roots do not equal the last committed post-update roots", index
        )
        self.report.final = {name: root.hex() for name, root in zip(ROOTS, final, strict=True)}


#: How often (in records) :func:`verify_transcript` reports progress.
PROGRESS_RECORDS = 256


def verify_transcript(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
    *,
    probes: bool = True,
    probes_path: str | os.PathLike[str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> VerificationReport:
    """Verify a transcript offline; never raises for bad transcript data.

    Args:
        source: a proof directory, a ``records.cborl`` path, its bytes, or a binary file.
        probes: also check probe continuity (needs ``probes.bin`` beside the records;
            only possible when ``source`` is a path, or with ``probes_path``).
        probes_path: the probe file to check, wherever it is (a platform keeps it apart
            from the transcript); overrides the file beside the records.
        on_progress: called with the bytes of the transcript verified so far, every
            ``PROGRESS_RECORDS`` records (a long verification can report how far it got).

    Returns:
        A :class:`VerificationReport`; ``ok`` is True only if every check passed.
    """
    import time

    started = time.perf_counter()
    probes_file: Path | None = None
    if probes and probes_path is not None:
        probes_file = Path(probes_path)
    elif probes and isinstance(source, (str, os.PathLike)):
        path = Path(source)
        probes_file = (path if path.is_dir() else path.parent) / PROBES_FILE
    verifier = _Verifier(probes_file)
    report = verifier.report
    try:
        digest = verifier.run(_buffer(source), on_progress)
        report.ok = True
        report.digest = digest.hex()
    except TranscriptError as error:
        report.ok = False
        report.reason = error.reason
        report.message = error.detail
        report.record = error.record
        report.field = error.field
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as error:
        # A field of a type or size no check anticipated (a list where a string belongs,
        # an integer too large to print or to convert): still bad data, so still a report.
        report.ok = False
        report.reason = "schema"
        report.message = f"a field has an unexpected type or value ({type(error).__name__})"
        report.record = verifier.index if verifier.index >= 0 else None
    except OSError as error:
        report.ok = False
        report.reason = "io_error"
        report.message = f"{type(error).__name__}: {error}"
    report.wall_seconds = time.perf_counter() - started
    return report
