"""The verifier's pass over the records: the chain, and each record kind's rules.

:func:`verify_transcript` runs a :class:`Verifier` over the framed records
(:mod:`zkdv.verify._frames`): the root's rules are in :mod:`zkdv.verify._root`; the
rules of step, check, snapshot and close records, which depend on the records before
them (order, sampling, snapshots, probes, counts), are :class:`Verifier`'s methods.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from zkdv.errors import TranscriptError
from zkdv.hashing import ZERO_DIGEST, Domain, hash_bytes
from zkdv.probes import ProbeSet
from zkdv.records import PROBES_FILE, Record
from zkdv.sampling import Challenge, Sampler
from zkdv.verify._frames import frames, transcript_bytes
from zkdv.verify._report import VerificationReport
from zkdv.verify._root import probe_floats, read_root
from zkdv.verify._schema import (
    BATCH_FIELDS,
    CHECK_ALLOWED,
    CHECK_FIELDS,
    CLOSE_FIELDS,
    FILE_FIELDS,
    MAX_HP_GROUPS,
    MAX_HP_VALUES,
    OPENED,
    PROBE_FIELDS,
    ROOTS,
    SNAP_FIELDS,
    STEP_ALLOWED,
    STEP_REQUIRED,
    fail,
    is_number,
    require,
    require_digest,
    require_int,
    require_keys,
    require_roots,
)

_INF = math.inf
#: How often (in records) :func:`verify_transcript` reports progress.
PROGRESS_RECORDS = 256


class Verifier:
    """One pass over a transcript's records: the root's terms and the state the records
    so far have committed (the next step, pending checks, snapshots, probes)."""

    def __init__(self, probes_path: Path | None) -> None:
        self.report = VerificationReport()
        self.index = -1
        self.probes_path = probes_path
        self._probe_data: np.ndarray | None = None

    # --- root ---------------------------------------------------------------------------
    def root(self, record: Record) -> None:
        """Check the root record, and start the state the records after it continue."""
        terms = read_root(record.data, record.index)
        self.terms = terms
        # What the per-record loop reads on every step, kept as attributes of its own.
        self.grad = terms.grad
        self.batch_cols = terms.batch_cols
        self.snapshot_interval = terms.snapshot_interval
        self.post = terms.initial
        self.sampler = Sampler(
            terms.config.sampling_policy,
            param_count=sum(spec.size for spec in terms.param_specs),
            state_count=sum(spec.size for spec in terms.state_specs),
        )
        # Every step's probe block has this length, and starts where the last one ended:
        # pre, post and delta probes, and the gradient's when the run commits it.
        self.probe_parts = 4 if self.grad else 3
        self.probe_bytes = self.probe_parts * 4 * probe_floats(terms.param_specs, terms.probe_ratio)
        # A step record's field count: nine, plus its computed values' root, plus hp.
        self.step_fields = 10 if self.grad else 9
        self.probe_end = 0
        self.report.root = record.data
        self.pending: dict[int, Any] = {}
        self.next_step = 0
        # The next step whose pre-state the interval puts a snapshot before, and the
        # latest snapshot recorded (step, record index).
        self.snapshot_due = 0
        self.last_snapshot = -1
        self.last_snapshot_record = -1
        self.last_probe: np.ndarray | None = None
        self.probe_set: ProbeSet | None = None

    # --- the record loop --------------------------------------------------------------
    def run(self, view: memoryview, on_progress: Callable[[int], None] | None) -> bytes:
        """Verify every record in ``view``; returns the transcript digest.

        The loop checks the chain and hands each record to its kind's rules. A
        well-formed step or snapshot record is checked inline (:meth:`_plain_step`,
        :meth:`_plain_snapshot`): plain lookups and identity type checks, every one a
        rule of the protocol. Anything unusual falls through to the precise validation
        in :meth:`_step_checked` or :meth:`snapshot`, which names the offending field.
        """
        index = 0
        prev = ZERO_DIGEST
        closed = False
        for offset, end, digest, data in frames(view):
            self.index = index
            if on_progress is not None and not index % PROGRESS_RECORDS:
                on_progress(offset)
            if closed:
                raise fail("after_close", "records follow the close record", index)
            if not index:
                self.root(Record(index, offset, end - offset, digest, data))
            else:
                if data.get("prev") != prev:
                    raise fail(
                        "broken_chain",
                        "prev does not match the hash of the previous record (an edited, dropped or reordered record)",
                        index,
                        "prev",
                    )
                kind = data.get("t")
                if kind == "step":
                    if not self._plain_step(data, digest, index):
                        self._step_checked(Record(index, offset, end - offset, digest, data))
                elif kind == "check":
                    self.check(Record(index, offset, end - offset, digest, data))
                elif kind == "snap":
                    if not self._plain_snapshot(data, index):
                        self.snapshot(Record(index, offset, end - offset, digest, data))
                elif kind == "close":
                    self.close(Record(index, offset, end - offset, digest, data))
                    closed = True
                else:
                    raise fail("schema", f"unknown record type {kind!r:.40}", index, "t")
            prev = digest
            index += 1
        if not index:
            raise fail("empty", "the transcript holds no records", None)
        if not closed:
            raise fail(
                "missing_close",
                f"the transcript ends after record {index - 1} without a close record (the run was not closed)",
                index,
            )
        return prev

    def _plain_step(self, data: dict[str, Any], digest: bytes, index: int) -> bool:
        """Check and commit a well-formed step record, the common case, inline; returns
        False, having changed nothing, for any other (:meth:`_step_checked` judges it)."""
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
            plain = (
                type(step) is int
                and step == self.next_step
                and (step != self.snapshot_due or self.last_snapshot == step)
                and (
                    len(data) == self.step_fields
                    or (len(data) == self.step_fields + 1 and "hp" in data)
                )
                and (not self.grad or (type(data["grad"]) is bytes and len(data["grad"]) == 32))
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
            return False
        if not plain:
            return False
        if probe is not None:
            self._probe(step, probe, index)
        if len(data) > self.step_fields:
            self._hp(step, data["hp"], index)
        report = self.report
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
        return True

    def _plain_snapshot(self, data: dict[str, Any], index: int) -> bool:
        """Record the common snapshot inline: where the interval puts it, no files listed,
        roots equal to the committed ones (which are 32-byte digests, so equal ones are
        too). Returns False, having changed nothing, for any other (:meth:`snapshot`)."""
        step, roots_map = data.get("i"), data.get("roots")
        if not (
            type(step) is int
            and step == self.next_step
            and step == self.snapshot_due
            and step != self.last_snapshot
            and len(data) == 5
            and data.get("files") == {}
            and type(roots_map) is dict
            and len(roots_map) == 3
            and (roots_map.get("p"), roots_map.get("o"), roots_map.get("b")) == self.post
        ):
            return False
        self.last_snapshot = step
        self.last_snapshot_record = index
        self.report.snapshots.append(step)
        return True

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
        step = require(data, "i", int, index)
        if step != self.next_step:
            kind = "duplicated" if step < self.next_step else "missing or reordered"
            raise fail(
                "step_order",
                f"expected step {self.next_step}, found step {step} ({kind} step record)",
                index,
                "i",
            )
        if step == self.snapshot_due and self.last_snapshot != step:
            raise fail(
                "missing_snapshot",
                f"step {step} has no snapshot record of its pre-state: snapshot_interval "
                f"{self.snapshot_interval} puts one before step {step}'s record",
                index,
                "i",
            )
        for key in ("program", "config"):
            if key in data:
                raise fail(
                    "program_changed",
                    f"step {step} changes the {key} fixed by the root record",
                    index,
                    key,
                )
        require_keys(data, STEP_REQUIRED, STEP_ALLOWED, index, f"step record {step}")
        if self.grad:
            require_digest(data, "grad", index)
        elif "grad" in data:
            raise fail(
                "schema",
                f"step record {step} commits computed values (grad) but the root's schema does not",
                index,
                "grad",
            )
        batch = require(data, "batch", dict, index)
        require_keys(batch, BATCH_FIELDS, BATCH_FIELDS, index, "batch", "batch.")
        require_digest(batch, "root", index, "batch.")
        require_digest(batch, "win", index, "batch.")
        cols = require_int(batch, "cols", index, prefix="batch.")
        if cols != self.batch_cols:
            raise fail(
                "batch_shape",
                f"step {step} commits a batch of {cols} columns; the schema fixes {self.batch_cols}",
                index,
                "batch.cols",
            )
        if require_int(batch, "rows", index, prefix="batch.") < 1:
            raise fail("batch_shape", f"step {step} commits an empty batch", index, "batch.rows")
        post = require_roots(data, "post", index)
        tokens = require_int(data, "tokens", index)
        flops = data["flops"]
        if flops is not None and (not is_number(flops) or flops < 0):
            raise fail(
                "schema", "flops must be a finite non-negative number or null", index, "flops"
            )
        times = data["time"]
        if not (type(times) is list and len(times) == 2 and all(is_number(t) for t in times)):
            raise fail("schema", "time must be [start, end], two finite numbers", index, "time")
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
            raise fail("schema", "probe must be {off, len, digest} or null", index, "probe")
        require_keys(probe, PROBE_FIELDS, PROBE_FIELDS, index, "probe", "probe.")
        offset = require_int(probe, "off", index, prefix="probe.")
        length = require_int(probe, "len", index, prefix="probe.")
        require_digest(probe, "digest", index, "probe.")
        if offset != self.probe_end or length != self.probe_bytes:
            raise fail(
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
            raise fail(
                "schema",
                f"step {step} hp must be a list of at most {MAX_HP_GROUPS} maps, one per optimizer group",
                index,
                "hp",
            )
        groups = self.terms.hp_groups
        if groups is not None and len(hp) != len(groups):
            raise fail(
                "schema",
                f"step {step} hp has {len(hp)} groups; the root's env.optimizer.groups records {len(groups)}",
                index,
                "hp",
            )
        for group, options in enumerate(hp):
            if type(options) is not dict:
                raise fail("schema", f"step {step} hp group {group} must be a map", index, "hp")
            for key, value in options.items():
                if type(key) is not str:
                    raise fail(
                        "schema",
                        f"step {step} hp group {group}: option name {key!r:.40} is not text",
                        index,
                        "hp",
                    )
                if groups is not None and key not in groups[group]:
                    raise fail(
                        "schema",
                        f"step {step} hp group {group}: option {key!r:.60} is not among the "
                        f"options env.optimizer.groups[{group}] records",
                        index,
                        "hp",
                    )
                if is_number(value):
                    continue
                if (
                    type(value) is list
                    and len(value) <= MAX_HP_VALUES
                    and all(is_number(v) for v in value)
                ):
                    continue
                raise fail(
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
                raise fail(
                    "probe_missing",
                    f"step {step} references probes but {PROBES_FILE} is absent",
                    index,
                    "probe",
                )
            self._probe_raw = path.read_bytes()
            self._probe_data = np.frombuffer(self._probe_raw, dtype="<f4")
            terms = self.terms
            self.probe_set = ProbeSet.create(terms.param_specs, terms.probe_ratio, terms.probe_seed)
        offset, length = probe["off"], probe["len"]
        if offset + length > len(self._probe_raw):
            raise fail(
                "probe_missing",
                f"step {step} probe range {offset}+{length} is outside {PROBES_FILE} ({len(self._probe_raw)} bytes)",
                index,
                "probe",
            )
        raw = self._probe_raw[offset : offset + length]
        if hash_bytes(Domain.PROBE, raw) != probe["digest"]:
            raise fail(
                "probe_digest",
                f"step {step} probe bytes do not match their committed digest",
                index,
                "probe.digest",
            )
        values = np.frombuffer(raw, dtype="<f4").reshape(self.probe_parts, -1)
        pre, post, delta = values[:3]
        tol = self.terms.config.tolerance
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
            raise fail(
                "probe_discontinuity",
                f"{what}: coordinate {worst} differs by {diff[worst]:.3g} (tolerance {bound[worst]:.3g})",
                index,
                "probe",
            )

    # --- checks, snapshots, close -------------------------------------------------------
    def check(self, record: Record) -> None:
        """A check record: for a sampled step, after it, opening the sampled coordinates,
        replaying from the snapshot before it, with a verdict its values bear out."""
        data, index = record.data, record.index
        step = require(data, "i", int, index)
        challenge = self._challenge(step, index)
        require_keys(data, CHECK_FIELDS, CHECK_ALLOWED, index, f"check record of step {step}")
        if "grad" in data and not self.grad:
            raise fail(
                "schema",
                f"check of step {step} judges a gradient (grad) but the root's schema commits none",
                index,
                "grad",
            )
        param = require(data, "param", dict, index)
        state = require(data, "state", dict, index)
        require_keys(param, OPENED, OPENED, index, "param", "param.")
        require_keys(state, OPENED, OPENED, index, "state", "state.")
        if require_int(param, "index", index, prefix="param.") != challenge.param_index:
            raise fail(
                "altered_check",
                f"check of step {step} opened parameter {param['index']}, the transcript sampled {challenge.param_index}",
                index,
                "param.index",
            )
        if require_int(state, "index", index, prefix="state.") != challenge.state_index:
            raise fail(
                "altered_check",
                f"check of step {step} opened optimizer-state coordinate {state['index']}, the transcript sampled {challenge.state_index}",
                index,
                "state.index",
            )
        self._check_replay_span(step, data, index)
        self._check_verdict(step, data, param, state, index)
        self.report.checks += 1

    def _challenge(self, step: int, index: int) -> Challenge:
        """The sampled step's pending challenge, which its check record answers."""
        challenge: Challenge | None = self.pending.pop(step, None)
        if challenge is None:
            if step >= self.next_step:
                raise fail(
                    "check_order", f"check for step {step} precedes that step's record", index, "i"
                )
            raise fail(
                "unexpected_check",
                f"step {step} was not sampled (or was already checked); its check record is forged or duplicated",
                index,
                "i",
            )
        return challenge

    def _check_replay_span(self, step: int, data: Mapping[str, Any], index: int) -> None:
        # A check replays from the snapshot that precedes its step: the latest multiple
        # of the interval, through every step after it.
        start = step - step % self.snapshot_interval
        if require_int(data, "from", index) != start:
            raise fail(
                "altered_check",
                f"check of step {step} replays from step {data['from']}; the snapshot it must "
                f"start from is step {start} (snapshot_interval {self.snapshot_interval})",
                index,
                "from",
            )
        if require_int(data, "replayed", index) != step - start:
            raise fail(
                "altered_check",
                f"check of step {step} says it replayed {data['replayed']} steps before the "
                f"checked one; from step {start} that is {step - start}",
                index,
                "replayed",
            )

    def _check_verdict(
        self,
        step: int,
        data: Mapping[str, Any],
        param: Mapping[str, Any],
        state: Mapping[str, Any],
        index: int,
    ) -> None:
        """The check's ``ok`` is what its committed and replayed values give, and true."""
        tol = self.terms.config.tolerance
        verdicts = []
        for name, values in (("param", param), ("state", state)):
            committed, replayed = values["committed"], values["replayed"]
            for key, value in (("committed", committed), ("replayed", replayed)):
                if type(value) is not float and type(value) is not int:
                    raise fail(
                        "schema",
                        f"{name}.{key} must be a number, got {type(value).__name__}",
                        index,
                        f"{name}.{key}",
                    )
            verdicts.append(
                (name, committed, replayed, tol.close(float(replayed), float(committed)))
            )
        ok = require(data, "ok", bool, index)
        gradient = require(data, "grad", bool, index) if "grad" in data else None
        recomputed = all(v[3] for v in verdicts) and gradient is not False
        if ok != recomputed:
            raise fail(
                "altered_check",
                f"check of step {step} claims ok={ok} but its values give ok={recomputed}",
                index,
                "ok",
            )
        if not ok and gradient is False:
            raise fail(
                "failed_check",
                f"sampled check of step {step} failed: the gradient recomputed from its "
                f"committed batch lies outside the run's gradient bounds of the committed one",
                index,
                "grad",
            )
        if not ok:
            name, committed, replayed, _ = next(v for v in verdicts if not v[3])
            raise fail(
                "failed_check",
                f"sampled check of step {step} failed: {name} committed {committed!r}, replayed {replayed!r} (tolerance abs {tol.absolute:g}, rel {tol.relative:g})",
                index,
                name,
            )

    def snapshot(self, record: Record) -> None:
        data, index = record.data, record.index
        step = require(data, "i", int, index)
        if step != self.next_step:
            raise fail(
                "snapshot_order",
                f"snapshot of the pre-state of step {step} recorded before step {self.next_step}",
                index,
                "i",
            )
        if self.last_snapshot == step:
            raise fail("snapshot_order", f"snapshot of step {step} is recorded twice", index, "i")
        if step != self.snapshot_due:
            raise fail(
                "unexpected_snapshot",
                f"snapshot of the pre-state of step {step}, which snapshot_interval "
                f"{self.snapshot_interval} does not name (snapshots precede steps 0, "
                f"{self.snapshot_interval}, {2 * self.snapshot_interval}, ...)",
                index,
                "i",
            )
        require_keys(data, SNAP_FIELDS, SNAP_FIELDS, index, f"snapshot record of step {step}")
        self._continues(
            require_roots(data, "roots", index),
            "roots",
            f"snapshot roots of step {step} do not continue the committed state",
            index,
        )
        files = require(data, "files", dict, index)
        for name, entry in files.items():
            if not isinstance(name, str) or not isinstance(entry, dict):
                raise fail(
                    "schema", f"snapshot file entry {name!r:.60} is malformed", index, "files"
                )
            require_keys(
                entry,
                FILE_FIELDS,
                FILE_FIELDS,
                index,
                f"snapshot file entry {name!r:.60}",
                "files.",
            )
            require_digest(entry, "digest", index, "files.")
            require_int(entry, "bytes", index, prefix="files.")
        self.last_snapshot = step
        self.last_snapshot_record = index
        self.report.snapshots.append(step)

    def _continues(self, roots: tuple[bytes, ...], field: str, message: str, index: int) -> None:
        """Reject ``roots`` unless they equal the last committed post-update roots."""
        if roots != self.post:
            which = next(n for n, a, b in zip(ROOTS, roots, self.post, strict=True) if a != b)
            raise fail(
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
            raise fail(
                "unexpected_snapshot",
                f"snapshot of the pre-state of step {self.last_snapshot}, but the run ends "
                f"after {self.next_step} steps",
                self.last_snapshot_record,
                "i",
            )
        if self.pending:
            step = min(self.pending)
            raise fail(
                "missing_check",
                f"step {step} was sampled but has no check record (a skipped check)",
                index,
            )
        require_keys(data, CLOSE_FIELDS, CLOSE_FIELDS, index, "the close record")
        steps = require_int(data, "steps", index)
        if steps != self.report.steps:
            raise fail(
                "count_mismatch",
                f"close record counts {steps} steps, the transcript has {self.report.steps}",
                index,
                "steps",
            )
        checks = require_int(data, "checks", index)
        if checks != self.report.checks:
            raise fail(
                "count_mismatch",
                f"close record counts {checks} checks, the transcript has {self.report.checks}",
                index,
                "checks",
            )
        final = require_roots(data, "final", index)
        self._continues(
            final, "final", "final roots do not equal the last committed post-update roots", index
        )
        self.report.final = {name: root.hex() for name, root in zip(ROOTS, final, strict=True)}


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
    verifier = Verifier(probes_file)
    report = verifier.report
    try:
        digest = verifier.run(transcript_bytes(source), on_progress)
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
