"""The offline transcript verifier: everything in the protocol that needs no replay.

It checks, in one streaming pass, and names the first problem with its record index:
the hash chain; record order (no reordered, duplicated or missing step); the root's
schema and configuration; that nothing changes the program or configuration mid-run;
batch shapes; every sampling decision recomputed from the step record's hash, with a
passing, correctly-indexed check record for each sampled step and none for others;
snapshot roots continuing the committed state; probe continuity and linearity within
the run's tolerance; and the close record's counts and final roots.

``python -m zkdv verify PROOF_DIR [--json]`` wraps :func:`verify_transcript`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import IO, Any

import numpy as np

from zkdv.config import ZKDVConfig
from zkdv.errors import TranscriptError
from zkdv.hashing import ZERO_DIGEST, Domain, hash_bytes
from zkdv.merkle import LeafSpec
from zkdv.probes import ProbeSet
from zkdv.records import PROBES_FILE, PROTOCOL_VERSION, Record, iter_records
from zkdv.sampling import Sampler

__all__ = ["VerificationReport", "verify_transcript"]

PROVERS = ("whitebox-jax", "whitebox-torch")
ROOT_KEYS = (
    "v",
    "prover",
    "config",
    "program",
    "schema",
    "initial",
    "env",
    "experiment",
    "probe_seed",
)
ROOTS = ("p", "o", "b")


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


def _require(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], record: int) -> Any:
    if key not in data:
        raise _fail("schema", f"missing field {key!r}", record, key)
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = (
            kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        )
        raise _fail(
            "schema", f"field {key!r} must be {expected}, got {type(value).__name__}", record, key
        )
    return value


def _digest(data: Mapping[str, Any], key: str, record: int) -> bytes:
    value = _require(data, key, bytes, record)
    if len(value) != 32:
        raise _fail(
            "schema", f"field {key!r} must be a 32-byte digest, got {len(value)} bytes", record, key
        )
    return bytes(value)


def _roots(data: Mapping[str, Any], key: str, record: int) -> tuple[bytes, bytes, bytes]:
    value = _require(data, key, dict, record)
    return tuple(_digest(value, name, record) for name in ROOTS)  # type: ignore[return-value]


def _specs(schema: Mapping[str, Any], key: str, record: int) -> tuple[LeafSpec, ...]:
    leaves = _require(schema, key, list, record)
    try:
        return tuple(LeafSpec.from_dict(leaf) for leaf in leaves)
    except (KeyError, TypeError, ValueError) as error:
        raise _fail(
            "schema", f"schema.{key} has a malformed leaf: {error}", record, f"schema.{key}"
        ) from None


class _Verifier:
    def __init__(self, probes_path: Path | None) -> None:
        self.report = VerificationReport()
        self.probes_path = probes_path
        self._probe_data: np.ndarray | None = None

    # --- root ---------------------------------------------------------------------------
    def root(self, record: Record) -> None:
        data = record.data
        if data.get("t") != "root":
            raise _fail(
                "missing_root",
                f"the first record must be the root, got {data.get('t')!r}",
                record.index,
                "t",
            )
        if data.get("v") != PROTOCOL_VERSION:
            raise _fail(
                "version",
                f"protocol version {data.get('v')!r} is not supported (expected {PROTOCOL_VERSION})",
                record.index,
                "v",
            )
        for key in ROOT_KEYS:
            if key not in data:
                raise _fail("schema", f"root record is missing {key!r}", record.index, key)
        if _digest(data, "prev", record.index) != ZERO_DIGEST:
            raise _fail(
                "broken_chain", "the root record's prev must be 32 zero bytes", record.index, "prev"
            )
        if data["prover"] not in PROVERS:
            raise _fail(
                "schema",
                f"unknown prover {data['prover']!r}; expected one of {', '.join(PROVERS)}",
                record.index,
                "prover",
            )
        config = _require(data, "config", dict, record.index)
        try:
            self.config = ZKDVConfig.from_dict(config)
            self.rolling_window = int(config["rolling_window"])
            self.probe_ratio = float(config["probe_ratio"])
            self.snapshot_interval = int(config["snapshot_interval"])
        except (KeyError, TypeError, ValueError) as error:
            raise _fail(
                "schema", f"root config is malformed: {error}", record.index, "config"
            ) from None
        schema = _require(data, "schema", dict, record.index)
        self.param_specs = _specs(schema, "params", record.index)
        self.state_specs = _specs(schema, "opt_state", record.index)
        _specs(schema, "buffers", record.index)
        batch = _require(schema, "batch", dict, record.index)
        self.batch_cols = _require(batch, "cols", int, record.index)
        if self.rolling_window < 1 or self.rolling_window > self.batch_cols:
            raise _fail(
                "schema",
                f"rolling_window {self.rolling_window} must be between 1 and the batch row width {self.batch_cols}",
                record.index,
                "config.rolling_window",
            )
        self.param_count = sum(spec.size for spec in self.param_specs)
        self.state_count = sum(spec.size for spec in self.state_specs)
        self.sampler = Sampler(
            self.config.sampling_policy, param_count=self.param_count, state_count=self.state_count
        )
        self.post = _roots(data, "initial", record.index)
        self.probe_seed = _require(data, "probe_seed", bytes, record.index)
        self.program = data["program"]
        experiment = data["experiment"]
        if experiment is not None and (
            not isinstance(experiment, dict)
            or not isinstance(experiment.get("name"), str)
            or not isinstance(experiment.get("spec_digest"), str)
        ):
            raise _fail(
                "schema",
                "experiment must be {name, spec_digest} or null",
                record.index,
                "experiment",
            )
        self.report.root = data
        self.pending: dict[int, Any] = {}
        self.next_step = 0
        self.last_probe: np.ndarray | None = None
        self.probe_set: ProbeSet | None = None

    # --- steps --------------------------------------------------------------------------
    def step(self, record: Record) -> None:
        # Fast path for the common, well-formed record: plain lookups and identity type
        # checks. Anything unusual falls through to the precise validation below, which
        # names the offending field.
        data = record.data
        try:
            batch, post, probe, flops, tokens = (
                data["batch"],
                data["post"],
                data.get("probe"),
                data.get("flops"),
                data["tokens"],
            )
            roots = (post["p"], post["o"], post["b"])
            fast = (
                data["i"] == self.next_step
                and "program" not in data
                and "config" not in data
                and type(tokens) is int
                and tokens >= 0
                and (probe is None or self.probes_path is None)
                and type(batch["root"]) is bytes
                and len(batch["root"]) == 32
                and type(batch["win"]) is bytes
                and len(batch["win"]) == 32
                and batch["cols"] == self.batch_cols
                and type(batch["rows"]) is int
                and batch["rows"] >= 1
                and type(roots[0]) is bytes
                and type(roots[1]) is bytes
                and type(roots[2]) is bytes
                and len(roots[0]) == len(roots[1]) == len(roots[2]) == 32
                and (flops is None or (type(flops) is float and 0.0 <= flops < math.inf))
            )
        except (KeyError, TypeError):
            fast = False
        if not fast:
            self._step_checked(record)
            return
        self.report.tokens += tokens
        if flops is not None:
            self.report.flops += flops
        self._sample(record)
        self.post = roots
        self.next_step += 1
        self.report.steps += 1

    def _sample(self, record: Record) -> None:
        step = self.next_step
        challenge = self.sampler.decide(step, record.hash)
        if challenge is not None:
            self.pending[step] = challenge
            self.report.sampled.append(step)

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
        for key in ("program", "config"):
            if key in data:
                raise _fail(
                    "program_changed",
                    f"step {step} changes the {key} fixed by the root record",
                    index,
                    key,
                )
        batch = _require(data, "batch", dict, index)
        _digest(batch, "root", index)
        _digest(batch, "win", index)
        if _require(batch, "cols", int, index) != self.batch_cols:
            raise _fail(
                "batch_shape",
                f"step {step} commits a batch of {batch['cols']} columns; the schema fixes {self.batch_cols}",
                index,
                "batch.cols",
            )
        if _require(batch, "rows", int, index) < 1:
            raise _fail("batch_shape", f"step {step} commits an empty batch", index, "batch.rows")
        post = _roots(data, "post", index)
        tokens = _require(data, "tokens", int, index)
        if tokens < 0:
            raise _fail("schema", "tokens must not be negative", index, "tokens")
        flops = data.get("flops")
        if flops is not None:
            if not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops < 0:
                raise _fail(
                    "schema", "flops must be a finite non-negative number or null", index, "flops"
                )
            self.report.flops += float(flops)
        self.report.tokens += tokens
        probe = data.get("probe")
        if probe is not None and self.probes_path is not None:
            self._check_probes(step, probe, index)
        self._sample(record)
        self.post = post
        self.next_step += 1
        self.report.steps += 1

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
        offset = _require(probe, "off", int, index)
        length = _require(probe, "len", int, index)
        digest = _digest(probe, "digest", index)
        assert self.probe_set is not None
        expected = 3 * 4 * self.probe_set.floats
        if length != expected or offset < 0 or offset + length > len(self._probe_raw):
            raise _fail(
                "probe_missing",
                f"step {step} probe range {offset}+{length} is outside {PROBES_FILE} or not {expected} bytes",
                index,
                "probe",
            )
        raw = self._probe_raw[offset : offset + length]
        if hash_bytes(Domain.PROBE, raw) != digest:
            raise _fail(
                "probe_digest",
                f"step {step} probe bytes do not match their committed digest",
                index,
                "probe.digest",
            )
        values = np.frombuffer(raw, dtype="<f4").reshape(3, -1)
        pre, post, delta = values
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
        param = _require(data, "param", dict, index)
        state = _require(data, "state", dict, index)
        if _require(param, "index", int, index) != challenge.param_index:
            raise _fail(
                "altered_check",
                f"check of step {step} opened parameter {param['index']}, the transcript sampled {challenge.param_index}",
                index,
                "param.index",
            )
        if _require(state, "index", int, index) != challenge.state_index:
            raise _fail(
                "altered_check",
                f"check of step {step} opened optimizer-state coordinate {state['index']}, the transcript sampled {challenge.state_index}",
                index,
                "state.index",
            )
        tol = self.config.tolerance
        verdicts = []
        for name, values in (("param", param), ("state", state)):
            committed = _require(values, "committed", (int, float), index)
            replayed = _require(values, "replayed", (int, float), index)
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
        if self.report.snapshots and self.report.snapshots[-1] == step:
            raise _fail("snapshot_order", f"snapshot of step {step} is recorded twice", index, "i")
        self._continues(
            _roots(data, "roots", index),
            "roots",
            f"snapshot roots of step {step} do not continue the committed state",
            index,
        )
        files = _require(data, "files", dict, index)
        for name, entry in files.items():
            if not isinstance(entry, dict):
                raise _fail("schema", f"snapshot file entry {name!r} is malformed", index, "files")
            _digest(entry, "digest", index)
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
        if self.pending:
            step = min(self.pending)
            raise _fail(
                "missing_check",
                f"step {step} was sampled but has no check record (a skipped check)",
                index,
            )
        steps = _require(data, "steps", int, index)
        if steps != self.report.steps:
            raise _fail(
                "count_mismatch",
                f"close record counts {steps} steps, the transcript has {self.report.steps}",
                index,
                "steps",
            )
        checks = _require(data, "checks", int, index)
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
    prev = ZERO_DIGEST
    closed = False
    last_index = -1
    handlers = {"step": verifier.step, "check": verifier.check, "snap": verifier.snapshot}
    try:
        for record in iter_records(source):
            last_index = record.index
            if on_progress is not None and not record.index % PROGRESS_RECORDS:
                on_progress(record.offset)
            if closed:
                raise _fail("after_close", "records follow the close record", record.index)
            if record.index:
                got = record.data.get("prev")
                if got != prev:
                    raise _fail(
                        "broken_chain",
                        "prev does not match the hash of the previous record (an edited, dropped or reordered record)",
                        record.index,
                        "prev",
                    )
            prev = record.hash
            if record.index == 0:
                verifier.root(record)
                continue
            kind = record.data.get("t")
            if kind == "close":
                verifier.close(record)
                closed = True
                continue
            handler = handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise _fail("schema", f"unknown record type {kind!r}", record.index, "t")
            handler(record)
        if last_index < 0:
            raise _fail("empty", "the transcript holds no records", None)
        if not closed:
            raise _fail(
                "missing_close",
                f"the transcript ends after record {last_index} without a close record (the run was not closed)",
                last_index + 1,
            )
        report.ok = True
        report.digest = prev.hex()
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
        report.record = last_index if last_index >= 0 else None
    except OSError as error:
        report.ok = False
        report.reason = "io_error"
        report.message = f"{type(error).__name__}: {error}"
    report.wall_seconds = time.perf_counter() - started
    return report
