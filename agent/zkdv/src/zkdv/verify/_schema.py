"""The transcript's fields, and the typed readers that reject a record naming the field.

The tables hold the fields of every record and nested map the protocol defines
(``records.py`` documents them); the readers (:func:`require`, :func:`require_int`,
...) return a field's value or raise the :class:`~zkdv.errors.TranscriptError` that
names the record and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zkdv.errors import TranscriptError
from zkdv.merkle import LeafSpec

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
#: ``gradient_files``: whether a run that commits its gradients kept them as files
#: (``"always"``, or ``"never"``: a replay recomputes them bit for bit); a root without
#: it kept them.
CONFIG_ALLOWED = CONFIG_FIELDS | {"bounds", "token_unit", "gradient_files"}
#: The values ``config.gradient_files`` may record (``ZKDVConfig.gradient_files`` resolved).
GRADIENT_FILES_RECORDED = ("always", "never")
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
#: ``grad``: whether the checked step's recomputed gradient lay within the run's bounds of
#: the committed one, in a run that commits its gradients and where the check judged it.
CHECK_ALLOWED = CHECK_FIELDS | {"grad"}
OPENED = frozenset({"index", "committed", "replayed"})
SNAP_FIELDS = frozenset({"t", "i", "prev", "roots", "files"})
FILE_FIELDS = frozenset({"digest", "bytes"})
CLOSE_FIELDS = frozenset({"t", "prev", "steps", "checks", "final"})
ROOT_FIELDS = frozenset(ROOTS)
#: Bounds of a step record's ``hp`` (per-step optimizer hyperparameters, Torch).
MAX_HP_GROUPS = 1024
MAX_HP_VALUES = 16


def fail(
    reason: str, message: str, record: int | None, field: str | None = None
) -> TranscriptError:
    return TranscriptError(reason, message, record=record, field=field)


def require(
    data: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    record: int,
    prefix: str = "",
) -> Any:
    if key not in data:
        raise fail("schema", f"missing field {prefix}{key!r}", record, prefix + key)
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise fail(
            "schema",
            f"field {prefix}{key!r} must be {expected}, got {type(value).__name__}",
            record,
            prefix + key,
        )
    return value


def require_digest(data: Mapping[str, Any], key: str, record: int, prefix: str = "") -> bytes:
    value = require(data, key, bytes, record, prefix)
    if len(value) != 32:
        raise fail(
            "schema",
            f"field {prefix}{key!r} must be a 32-byte digest, got {len(value)} bytes",
            record,
            prefix + key,
        )
    return bytes(value)


def require_roots(data: Mapping[str, Any], key: str, record: int) -> tuple[bytes, bytes, bytes]:
    value = require(data, key, dict, record)
    require_keys(value, ROOT_FIELDS, ROOT_FIELDS, record, key, f"{key}.")
    return tuple(require_digest(value, name, record, f"{key}.") for name in ROOTS)  # type: ignore[return-value]


def require_specs(schema: Mapping[str, Any], key: str, record: int) -> tuple[LeafSpec, ...]:
    leaves = require(schema, key, list, record, "schema.")
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
            raise fail(
                "schema",
                f"schema.{key}[{number}] must be {{path, dtype, shape}}: text path and dtype, "
                "a list of non-negative integer dimensions",
                record,
                f"schema.{key}",
            )
        specs.append(LeafSpec(leaf["path"], leaf["dtype"], tuple(leaf["shape"])))
    return tuple(specs)


def is_number(value: Any) -> bool:
    """An int or a finite float (never a bool: CBOR keeps them apart, so must we)."""
    kind = type(value)
    return kind is int or (kind is float and -_INF < value < _INF)


def require_keys(
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
            raise fail("schema", f"{what} is missing {key!r}", record, prefix + key)
    for key in data:
        if key not in allowed:
            raise fail(
                "schema",
                f"{what} has a field the protocol does not define: {key!r}",
                record,
                f"{prefix}{key}",
            )


def require_int(
    data: Mapping[str, Any], key: str, record: int, *, minimum: int = 0, prefix: str = ""
) -> int:
    value = data.get(key)
    if type(value) is not int:
        raise fail(
            "schema",
            f"{prefix}{key} must be an integer, got {type(value).__name__}",
            record,
            prefix + key,
        )
    if value < minimum:
        raise fail(
            "schema", f"{prefix}{key} must be at least {minimum}, got {value}", record, prefix + key
        )
    return value


def require_number(data: Mapping[str, Any], key: str, record: int, *, prefix: str = "") -> float:
    value: Any = data.get(key)
    if not is_number(value):
        raise fail(
            "schema",
            f"{prefix}{key} must be a finite number, got {value!r:.40}",
            record,
            prefix + key,
        )
    return float(value)
