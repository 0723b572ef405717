"""The root record's rules, and what the root fixes for every record after it.

:func:`read_root` checks the root (its version, chain start, prover, configuration,
schema, program, initial roots, experiment and probe seed) and returns
:class:`RootTerms`: the configuration, schema and initial state that every later record
is checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from zkdv.config import TOKEN_UNITS, ZKDVConfig
from zkdv.gradients import split_name
from zkdv.hashing import ZERO_DIGEST
from zkdv.merkle import LeafSpec
from zkdv.probes import MAX_PROBE_ROWS, probe_columns
from zkdv.records import PROTOCOL_VERSION
from zkdv.verify._schema import (
    BATCH_SCHEMA,
    BERNOULLI,
    BOUNDS,
    CONFIG_ALLOWED,
    CONFIG_FIELDS,
    EVERY,
    EXPERIMENT_ALLOWED,
    EXPERIMENT_REQUIRED,
    GRADIENT_FILES_RECORDED,
    PROGRAM,
    PROVERS,
    ROOT_REQUIRED,
    SCHEMA_ALLOWED,
    SCHEMA_REQUIRED,
    TOLERANCE,
    fail,
    require,
    require_digest,
    require_int,
    require_keys,
    require_number,
    require_roots,
    require_specs,
)


@dataclass(frozen=True, slots=True)
class RootTerms:
    """What the root record fixes for every record after it."""

    config: ZKDVConfig
    param_specs: tuple[LeafSpec, ...]
    state_specs: tuple[LeafSpec, ...]
    #: Whether the run commits computed values (``schema.grad``).
    grad: bool
    batch_cols: int
    probe_ratio: float
    snapshot_interval: int
    #: The roots of the state before step 0.
    initial: tuple[bytes, bytes, bytes]
    #: The option keys of each optimizer group ``env.optimizer.groups`` records, if any.
    hp_groups: tuple[frozenset[Any], ...] | None
    probe_seed: bytes


class _ConfigTerms(NamedTuple):
    """What the root's ``config`` fixes beyond the :class:`ZKDVConfig` it describes."""

    config: ZKDVConfig
    bounds: bool
    rolling_window: int
    probe_ratio: float
    snapshot_interval: int


class _SchemaTerms(NamedTuple):
    """What the root's ``schema`` fixes: the state's leaves, computed values, batch width."""

    param_specs: tuple[LeafSpec, ...]
    state_specs: tuple[LeafSpec, ...]
    grad: bool
    batch_cols: int


def read_root(data: Mapping[str, Any], index: int) -> RootTerms:
    """Check the root record; returns what it fixes.

    Raises:
        TranscriptError: the first rule the root breaks, naming the field.
    """
    _check_header(data, index)
    config = _read_config(require(data, "config", dict, index), index)
    schema = _read_schema(require(data, "schema", dict, index), config.bounds, index)
    if config.rolling_window > schema.batch_cols:
        raise fail(
            "schema",
            f"rolling_window {config.rolling_window} must be between 1 and the batch row width {schema.batch_cols}",
            index,
            "config.rolling_window",
        )
    _check_program(data["program"], index)
    initial = require_roots(data, "initial", index)
    env = require(data, "env", dict, index)
    hp_groups = _hp_groups(env)
    _check_experiment(data["experiment"], index)
    seed = require(data, "probe_seed", bytes, index)
    if len(seed) != 16:
        raise fail("schema", f"probe_seed must be 16 bytes, got {len(seed)}", index, "probe_seed")
    require_number(data, "created", index)
    return RootTerms(
        config=config.config,
        param_specs=schema.param_specs,
        state_specs=schema.state_specs,
        grad=schema.grad,
        batch_cols=schema.batch_cols,
        probe_ratio=config.probe_ratio,
        snapshot_interval=config.snapshot_interval,
        initial=initial,
        hp_groups=hp_groups,
        probe_seed=bytes(seed),
    )


def probe_floats(specs: tuple[LeafSpec, ...], probe_ratio: float) -> int:
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


def _check_header(data: Mapping[str, Any], index: int) -> None:
    """The root's kind, protocol version, field set, chain start and prover."""
    if data.get("t") != "root":
        raise fail(
            "missing_root",
            f"the first record must be the root, got {data.get('t')!r:.40}",
            index,
            "t",
        )
    if type(data.get("v")) is not int or data["v"] != PROTOCOL_VERSION:
        raise fail(
            "version",
            f"protocol version {data.get('v')!r:.40} is not supported (expected {PROTOCOL_VERSION})",
            index,
            "v",
        )
    require_keys(data, ROOT_REQUIRED, ROOT_REQUIRED, index, "the root record")
    if require_digest(data, "prev", index) != ZERO_DIGEST:
        raise fail("broken_chain", "the root record's prev must be 32 zero bytes", index, "prev")
    if data["prover"] not in PROVERS:
        raise fail(
            "schema",
            f"unknown prover {data['prover']!r:.60}; expected one of {', '.join(PROVERS)}",
            index,
            "prover",
        )


def _read_config(config: Mapping[str, Any], index: int) -> _ConfigTerms:
    require_keys(config, CONFIG_FIELDS, CONFIG_ALLOWED, index, "config", "config.")
    bounds = "bounds" in config
    if bounds:
        _check_bounds(require(config, "bounds", dict, index, "config."), index)
    unit = config.get("token_unit", TOKEN_UNITS[0])
    if unit not in TOKEN_UNITS:
        raise fail(
            "schema",
            f"config.token_unit must be one of {', '.join(map(repr, TOKEN_UNITS))}, "
            f"got {unit!r:.40}",
            index,
            "config.token_unit",
        )
    kept = config.get("gradient_files", GRADIENT_FILES_RECORDED[0])
    if kept not in GRADIENT_FILES_RECORDED:
        raise fail(
            "schema",
            f"config.gradient_files must be 'always' or 'never', got {kept!r:.40}",
            index,
            "config.gradient_files",
        )
    name = config["name"]
    if not isinstance(name, str) or not name:
        raise fail("schema", "config.name must be a non-empty string", index, "config.name")
    _check_sampling(require(config, "sampling", dict, index), index)
    tolerance = require(config, "tolerance", dict, index)
    require_keys(tolerance, TOLERANCE, TOLERANCE, index, "config.tolerance", "config.tolerance.")
    for key in sorted(TOLERANCE):
        if require_number(tolerance, key, index, prefix="config.tolerance.") < 0:
            raise fail(
                "schema",
                f"config.tolerance.{key} must not be negative",
                index,
                f"config.tolerance.{key}",
            )
    chunk = require_int(config, "chunk_bytes", index, minimum=64, prefix="config.")
    if chunk & (chunk - 1):
        raise fail(
            "schema",
            f"config.chunk_bytes {chunk} must be a power of two",
            index,
            "config.chunk_bytes",
        )
    rolling_window = require_int(config, "rolling_window", index, minimum=1, prefix="config.")
    probe_ratio = require_number(config, "probe_ratio", index, prefix="config.")
    if not 0.0 < probe_ratio <= 1.0:
        raise fail("schema", "config.probe_ratio must be in (0, 1]", index, "config.probe_ratio")
    snapshot_interval = require_int(config, "snapshot_interval", index, minimum=1, prefix="config.")
    require_int(config, "max_in_flight", index, minimum=1, prefix="config.")
    return _ConfigTerms(
        ZKDVConfig.from_dict(dict(config)), bounds, rolling_window, probe_ratio, snapshot_interval
    )


def _check_bounds(bounds: Mapping[str, Any], index: int) -> None:
    require_keys(bounds, BOUNDS, BOUNDS, index, "config.bounds", "config.bounds.")
    for key in sorted(BOUNDS):
        if not 0.0 <= require_number(bounds, key, index, prefix="config.bounds.") < 1.0:
            raise fail(
                "schema",
                f"config.bounds.{key} must be in [0, 1)",
                index,
                f"config.bounds.{key}",
            )


def _check_sampling(sampling: Mapping[str, Any], index: int) -> None:
    kind = sampling.get("kind")
    if kind == "every":
        require_keys(sampling, EVERY, EVERY, index, "config.sampling", "config.sampling.")
        require_int(sampling, "n", index, minimum=1, prefix="config.sampling.")
    elif kind == "bernoulli":
        require_keys(sampling, BERNOULLI, BERNOULLI, index, "config.sampling", "config.sampling.")
        if not 0.0 <= require_number(sampling, "p", index, prefix="config.sampling.") <= 1.0:
            raise fail(
                "schema",
                "config.sampling.p must be a probability in [0, 1]",
                index,
                "config.sampling.p",
            )
    else:
        raise fail(
            "schema",
            f"config.sampling.kind must be 'every' or 'bernoulli', got {kind!r:.40}",
            index,
            "config.sampling.kind",
        )


def _read_schema(schema: Mapping[str, Any], config_bounds: bool, index: int) -> _SchemaTerms:
    require_keys(schema, SCHEMA_REQUIRED, SCHEMA_ALLOWED, index, "schema", "schema.")
    param_specs = require_specs(schema, "params", index)
    state_specs = require_specs(schema, "opt_state", index)
    buffer_specs = require_specs(schema, "buffers", index)
    grad = _grad_schema(
        schema,
        config_bounds=config_bounds,
        trees=(param_specs, state_specs, buffer_specs),
        index=index,
    )
    batch = require(schema, "batch", dict, index)
    require_keys(batch, BATCH_SCHEMA, BATCH_SCHEMA, index, "schema.batch", "schema.batch.")
    batch_cols = require_int(batch, "cols", index, minimum=1, prefix="schema.batch.")
    if batch["dtype"] != "uint32":
        raise fail(
            "schema",
            f"schema.batch.dtype must be 'uint32', got {batch['dtype']!r:.40}",
            index,
            "schema.batch.dtype",
        )
    return _SchemaTerms(param_specs, state_specs, grad, batch_cols)


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
            raise fail(
                "schema",
                "config.bounds is given but the schema commits no computed values (schema.grad)",
                index,
                "config.bounds",
            )
        return False
    if not config_bounds:
        raise fail(
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
    for number, spec in enumerate(require_specs(schema, "grad", index)):
        try:
            tree, path = split_name(spec.path)
        except ValueError as error:
            raise fail("schema", f"schema.grad[{number}]: {error}", index, "schema.grad") from None
        target = known[tree].get(path)
        if target is None or (target.dtype, target.shape) != (spec.dtype, spec.shape):
            raise fail(
                "schema",
                f"schema.grad[{number}] {spec.path!r:.80} does not name a {tree} leaf of "
                "the same dtype and shape",
                index,
                "schema.grad",
            )
        if spec.path in seen:
            raise fail("schema", f"schema.grad names {spec.path!r:.80} twice", index, "schema.grad")
        seen.add(spec.path)
    return True


def _check_program(program: Any, index: int) -> None:
    if program is None:
        return
    if not isinstance(program, dict):
        raise fail("schema", "program must be {kind, digest, bytes} or null", index, "program")
    require_keys(program, PROGRAM, PROGRAM, index, "program", "program.")
    if not isinstance(program["kind"], str) or not program["kind"]:
        raise fail("schema", "program.kind must be a non-empty string", index, "program.kind")
    require_digest(program, "digest", index)
    require_int(program, "bytes", index, prefix="program.")


def _check_experiment(experiment: Any, index: int) -> None:
    if experiment is None:
        return
    if not isinstance(experiment, dict):
        raise fail("schema", "experiment must be {name, spec_digest} or null", index, "experiment")
    require_keys(
        experiment, EXPERIMENT_REQUIRED, EXPERIMENT_ALLOWED, index, "experiment", "experiment."
    )
    for key in sorted(experiment):
        if not isinstance(experiment[key], str):
            raise fail("schema", f"experiment.{key} must be a string", index, f"experiment.{key}")


def _hp_groups(env: Mapping[str, Any]) -> tuple[frozenset[Any], ...] | None:
    """The option keys of each optimizer group the root records, if it records a list."""
    optimizer = env.get("optimizer")
    groups = optimizer.get("groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return None
    return tuple(frozenset(group) if isinstance(group, dict) else frozenset() for group in groups)
