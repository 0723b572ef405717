"""One test per rule of the transcript protocol (the table in docs/transcript.md).

Each test edits one field or position of an honest transcript, re-chains it as a forger
would (so the hash chain holds and the rule itself must catch the edit), and checks the
reason code, the record and the field the verifier names. Edits that change a step
record's hash also change the Fiat-Shamir draws of its check, so they use a transcript
without sampled checks: only the rule under test can reject them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.synthetic import write_synthetic_transcript
from zkdv.config import SamplingPolicy
from zkdv.hashing import ZERO_DIGEST
from zkdv.merkle import LeafSpec
from zkdv.probes import ProbeSet
from zkdv.records import RECORDS_FILE, encode, iter_records, record_hash
from zkdv.verify import verify_transcript
from zkdv.verify._root import probe_floats as _probe_floats

Records = list[dict[str, Any]]
NO_CHECKS = SamplingPolicy(update_check_probability=0.0)


def _write(path: Path, **options: Any) -> Records:
    write_synthetic_transcript(path, **options)
    return [r.data for r in iter_records(path / RECORDS_FILE)]


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Records:
    """7 steps, snapshots before steps 0, 3 and 6, checks of steps 0, 2, 4 and 6."""
    return _write(tmp_path_factory.mktemp("checked"), steps=7, snapshot_interval=3)


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory: pytest.TempPathFactory) -> Records:
    """6 steps, snapshots before steps 0 and 3 (none after the last), no sampled checks."""
    return _write(
        tmp_path_factory.mktemp("unchecked"), steps=6, snapshot_interval=3, sampling=NO_CHECKS
    )


def rechain(records: Records) -> bytes:
    out = bytearray()
    prev = ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    return bytes(out)


def verify(records: Records) -> Any:
    return verify_transcript(rechain(records), probes=False)


def at(records: Records, kind: str, step: int | None = None) -> int:
    return next(
        n for n, r in enumerate(records) if r["t"] == kind and (step is None or r["i"] == step)
    )


def edited(records: Records, index: int, **fields: Any) -> Records:
    out = list(records)
    out[index] = {**records[index], **fields}
    return out


def rejected(records: Records, reason: str, record: int, field: str | None = None) -> str:
    report = verify(records)
    assert (report.ok, report.reason, report.record) == (False, reason, record), report.summary()
    if field is not None:
        assert report.field == field, report.summary()
    assert report.message
    return str(report.message)


# --- honest runs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "interval", "every"),
    [(1, 1, 1), (6, 3, 2), (7, 3, 2), (9, 3, 1), (5, 12, 2), (12, 4, 5), (4, 1, 3)],
)
def test_honest_transcripts_verify(tmp_path: Path, steps: int, interval: int, every: int) -> None:
    # Among them: runs whose length is a multiple of the interval (no snapshot follows the
    # last step), an interval longer than the run, a snapshot before every step.
    write_synthetic_transcript(
        tmp_path,
        steps=steps,
        snapshot_interval=interval,
        sampling=SamplingPolicy.DEBUGCheckEvery(every),
    )
    report = verify_transcript(tmp_path)
    assert report.ok, report.summary()
    assert report.snapshots == list(range(0, steps, interval))
    assert report.sampled == list(range(0, steps, every))


# --- framing and order -------------------------------------------------------------------


def test_an_empty_transcript_is_rejected() -> None:
    report = verify_transcript(b"", probes=False)
    assert (report.ok, report.reason) == (False, "empty")


def test_the_first_record_is_the_root_of_version_1(unchecked: Records) -> None:
    rejected(unchecked[1:], "missing_root", 0, "t")
    rejected(_root(unchecked, v=2), "version", 0, "v")
    rejected(_root(unchecked, prover="whitebox-tf"), "schema", 0, "prover")


def test_the_chain_starts_at_zero_and_links_every_record(unchecked: Records) -> None:
    data = rechain(unchecked)
    chained = list(iter_records(data))
    step = at(unchecked, "step", 0)
    # One record edited (its token count) without re-chaining the records after it.
    edit = encode({**chained[step].data, "tokens": chained[step].data["tokens"] + 1})
    spans = [data[r.offset : r.offset + r.size] for r in chained]
    spans[step] = edit
    report = verify_transcript(b"".join(spans), probes=False)
    assert (report.reason, report.record, report.field) == ("broken_chain", step + 1, "prev")
    spans = [data[r.offset : r.offset + r.size] for r in chained]
    spans[0] = encode({**chained[0].data, "prev": b"\x01" * 32})
    report = verify_transcript(b"".join(spans), probes=False)
    assert (report.reason, report.record) == ("broken_chain", 0)


def test_nothing_follows_the_close_record_and_it_must_be_there(unchecked: Records) -> None:
    rejected([*unchecked, unchecked[-1]], "after_close", len(unchecked))
    rejected(unchecked[:-1], "missing_close", len(unchecked) - 1)


def test_an_unknown_record_type_is_rejected(unchecked: Records) -> None:
    rejected(edited(unchecked, 2, t="note"), "schema", 2, "t")
    rejected(edited(unchecked, 2, t=["step"]), "schema", 2, "t")


def test_steps_are_numbered_in_order(unchecked: Records) -> None:
    step2, step3 = at(unchecked, "step", 2), at(unchecked, "step", 3)
    message = rejected(
        [*unchecked[:step3], unchecked[step2], *unchecked[step3:]], "step_order", step3, "i"
    )
    assert "duplicated" in message


def test_a_check_follows_its_step(checked: Records) -> None:
    check, step = at(checked, "check", 4), at(checked, "step", 4)
    moved = [r for n, r in enumerate(checked) if n != check]
    moved.insert(step, checked[check])
    rejected(moved, "check_order", step, "i")


# --- snapshots --------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 3, 6])
def test_a_dropped_snapshot_is_a_missing_snapshot(checked: Records, step: int) -> None:
    # The case: before this rule, a dropped snapshot was caught only if a later
    # check's re-drawn coordinates happened to differ (1 in 56 runs they did not).
    snap = at(checked, "snap", step)
    message = rejected(checked[:snap] + checked[snap + 1 :], "missing_snapshot", snap, "i")
    assert f"step {step} has no snapshot record" in message


def test_a_snapshot_the_interval_does_not_name_is_unexpected(unchecked: Records) -> None:
    step4 = at(unchecked, "step", 4)
    snap = {"t": "snap", "i": 4, "roots": unchecked[step4 - 1]["post"], "files": {}}
    message = rejected(
        [*unchecked[:step4], snap, *unchecked[step4:]], "unexpected_snapshot", step4, "i"
    )
    assert "step 4" in message and "snapshot_interval 3" in message


def test_a_snapshot_after_the_last_step_is_unexpected(unchecked: Records) -> None:
    close = at(unchecked, "close")
    snap = {"t": "snap", "i": 6, "roots": unchecked[close]["final"], "files": {}}
    message = rejected(
        [*unchecked[:close], snap, *unchecked[close:]], "unexpected_snapshot", close, "i"
    )
    assert "ends after 6 steps" in message


def test_a_snapshot_away_from_its_step_is_out_of_order(unchecked: Records) -> None:
    snap, step2 = at(unchecked, "snap", 3), at(unchecked, "step", 2)
    moved = [r for n, r in enumerate(unchecked) if n != snap]
    moved.insert(step2, unchecked[snap])
    rejected(moved, "snapshot_order", step2, "i")


def test_snapshot_file_entries_are_digests_and_sizes(unchecked: Records) -> None:
    snap = at(unchecked, "snap", 3)
    good = {"files": {"snapshot.bin": {"digest": b"\x01" * 32, "bytes": 10}}}
    assert verify(edited(unchecked, snap, **good)).ok
    bad = {"files": {"snapshot.bin": {"digest": b"\x01" * 31, "bytes": 10}}}
    rejected(edited(unchecked, snap, **bad), "schema", snap, "files.digest")
    bad = {"files": {"snapshot.bin": {"digest": b"\x01" * 32, "bytes": -1}}}
    rejected(edited(unchecked, snap, **bad), "schema", snap, "files.bytes")


# --- sampled checks ---------------------------------------------------------------------


def test_a_check_replays_from_the_snapshot_before_its_step(checked: Records) -> None:
    check = at(checked, "check", 4)
    assert (checked[check]["from"], checked[check]["replayed"]) == (3, 1)
    message = rejected(edited(checked, check, **{"from": 4, "replayed": 0}), "altered_check", check)
    assert "the snapshot it must start from is step 3" in message
    rejected(edited(checked, check, replayed=2), "altered_check", check, "replayed")


def test_check_values_are_numbers(checked: Records) -> None:
    check = at(checked, "check", 2)
    param = {**checked[check]["param"], "replayed": True}
    rejected(edited(checked, check, param=param), "schema", check, "param.replayed")


def test_a_check_may_judge_the_whole_gradient_of_a_run_that_commits_it(
    tmp_path: Path, checked: Records
) -> None:
    records = _write(tmp_path / "proof", steps=5, snapshot_interval=3, gradients=True)
    # The last check: an edit of an earlier one would change the draws of later steps.
    check = at(records, "check", 4)
    assert verify(edited(records, check, grad=True)).ok
    # A gradient outside the bounds fails the check, whatever its two coordinates show.
    rejected(edited(records, check, grad=False), "altered_check", check, "ok")
    message = rejected(edited(records, check, grad=False, ok=False), "failed_check", check, "grad")
    assert "outside the run's gradient bounds" in message
    rejected(edited(records, check, grad=1), "schema", check, "grad")
    # A run that commits no gradient has none to judge.
    check = at(checked, "check", 2)
    rejected(edited(checked, check, grad=True), "schema", check, "grad")


# --- probes -----------------------------------------------------------------------------


def test_probe_blocks_follow_one_another(unchecked: Records) -> None:
    step = at(unchecked, "step", 2)
    probe = unchecked[step]["probe"]
    moved = {**probe, "off": probe["off"] + 4}
    rejected(edited(unchecked, step, probe=moved), "probe_range", step, "probe.off")
    shorter = {**probe, "len": probe["len"] - 12}
    rejected(edited(unchecked, step, probe=shorter), "probe_range", step, "probe.len")


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_the_probe_length_is_what_the_probe_set_draws(ratio: float) -> None:
    specs = tuple(
        LeafSpec(f"l{n}", "float32", shape)
        for n, shape in enumerate([(), (0,), (5, 0), (7,), (3, 10), (200, 33), (2, 3, 65), (1,)])
    )
    assert _probe_floats(specs, ratio) == ProbeSet.create(specs, ratio, b"\x00" * 16).floats


# --- fields of every record ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "field"),
    [("root", "x"), ("step", "x"), ("snap", "x"), ("close", "x"), ("check", "x")],
)
def test_a_field_the_protocol_does_not_define_is_rejected(
    checked: Records, unchecked: Records, kind: str, field: str
) -> None:
    records = checked if kind == "check" else unchecked
    index = at(records, kind)
    message = rejected(edited(records, index, **{field: 1}), "schema", index, field)
    assert "does not define" in message


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("batch", "extra"), 1, "batch.extra"),
        (("post", "q"), b"\x00" * 32, "post.q"),
        (("probe", "extra"), 0, "probe.extra"),
    ],
)
def test_nested_maps_have_exactly_their_fields(
    unchecked: Records, path: tuple[str, str], value: Any, field: str
) -> None:
    step = at(unchecked, "step", 1)
    outer, inner = path
    changed = {**unchecked[step][outer], inner: value}
    rejected(edited(unchecked, step, **{outer: changed}), "schema", step, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokens", -1),
        ("tokens", 1.5),
        ("tokens", True),
        ("flops", "1e12"),
        ("flops", math.inf),
        ("flops", -1.0),
        ("time", [1.0]),
        ("time", [math.nan, 1.0]),
        ("time", "now"),
        ("i", 1.0),
    ],
)
def test_step_fields_have_their_types_and_ranges(
    unchecked: Records, field: str, value: Any
) -> None:
    step = at(unchecked, "step", 1)
    report = verify(edited(unchecked, step, **{field: value}))
    assert (report.ok, report.record) == (False, step), report.summary()
    assert report.reason in {"schema", "step_order"}


@pytest.mark.parametrize("field", ["probe", "flops", "time", "tokens"])
def test_step_fields_are_required(unchecked: Records, field: str) -> None:
    step = at(unchecked, "step", 1)
    records = list(unchecked)
    records[step] = {k: v for k, v in unchecked[step].items() if k != field}
    rejected(records, "schema", step, field)


def test_a_batch_of_another_width_or_no_rows(unchecked: Records) -> None:
    step = at(unchecked, "step", 1)
    batch = unchecked[step]["batch"]
    rejected(edited(unchecked, step, batch={**batch, "cols": 8}), "batch_shape", step, "batch.cols")
    rejected(edited(unchecked, step, batch={**batch, "rows": 0}), "batch_shape", step, "batch.rows")


def _root(records: Records, **fields: Any) -> Records:
    return edited(records, 0, **fields)


def _config(records: Records, **fields: Any) -> Records:
    return _root(records, config={**records[0]["config"], **fields})


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"snapshot_interval": 0}, "config.snapshot_interval"),
        ({"snapshot_interval": "3"}, "config.snapshot_interval"),
        ({"snapshot_interval": 3.0}, "config.snapshot_interval"),
        ({"max_in_flight": 0}, "config.max_in_flight"),
        ({"chunk_bytes": 100}, "config.chunk_bytes"),
        ({"probe_ratio": 0.0}, "config.probe_ratio"),
        ({"probe_ratio": "0.5"}, "config.probe_ratio"),
        ({"rolling_window": 0}, "config.rolling_window"),
        ({"rolling_window": 99}, "config.rolling_window"),
        ({"sampling": {"kind": "bernoulli", "p": 2.0}}, "config.sampling.p"),
        ({"sampling": {"kind": "every", "n": 0}}, "config.sampling.n"),
        ({"sampling": {"kind": "every", "n": 2, "p": 0.1}}, "config.sampling.p"),
        ({"tolerance": {"abs": "1e-6", "rel": 0.001}}, "config.tolerance.abs"),
        ({"tolerance": {"abs": 1e-6, "rel": -1.0}}, "config.tolerance.rel"),
        ({"name": ""}, "config.name"),
        ({"extra": 1}, "config.extra"),
        ({"gradient_files": "auto"}, "config.gradient_files"),  # recorded as resolved
        ({"gradient_files": True}, "config.gradient_files"),
    ],
)
def test_the_configuration_has_its_types_and_ranges(
    unchecked: Records, fields: dict[str, Any], field: str
) -> None:
    rejected(_config(unchecked, **fields), "schema", 0, field)


def test_every_configuration_field_is_required(unchecked: Records) -> None:
    config = {k: v for k, v in unchecked[0]["config"].items() if k != "max_in_flight"}
    rejected(_root(unchecked, config=config), "schema", 0, "config.max_in_flight")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"probe_seed": b"\x00" * 15}, "probe_seed"),
        ({"created": math.nan}, "created"),
        ({"created": "yesterday"}, "created"),
        ({"env": ["python"]}, "env"),
        ({"program": {"kind": "jax.export", "digest": b"\x00" * 32}}, "program.bytes"),
        ({"program": {"kind": "", "digest": b"\x00" * 32, "bytes": 1}}, "program.kind"),
        ({"experiment": {"name": "a/b", "spec_digest": "00", "extra": "x"}}, "experiment.extra"),
        ({"experiment": {"name": "a/b", "spec_digest": 0}}, "experiment.spec_digest"),
        ({"initial": {"p": b"\x00" * 32, "o": b"\x00" * 32}}, "initial.b"),
    ],
)
def test_root_fields_have_their_types(
    unchecked: Records, fields: dict[str, Any], field: str
) -> None:
    rejected(_root(unchecked, **fields), "schema", 0, field)


def test_the_schema_has_its_types(unchecked: Records) -> None:
    schema = unchecked[0]["schema"]
    batch = {**schema["batch"], "dtype": "int32"}
    rejected(_root(unchecked, schema={**schema, "batch": batch}), "schema", 0, "schema.batch.dtype")
    leaf = {"path": "w", "dtype": "float32", "shape": [-1]}
    rejected(_root(unchecked, schema={**schema, "buffers": [leaf]}), "schema", 0, "schema.buffers")
    rejected(_root(unchecked, schema={**schema, "extra": 1}), "schema", 0, "schema.extra")
    sharded = {**schema, "sharding": {"params": [{"mesh": {"data": 2}, "spec": []}]}}
    assert verify(_root(unchecked, schema=sharded)).ok


def test_experiment_may_carry_a_regime_and_env_is_free_form(unchecked: Records) -> None:
    experiment = {"name": "acme/lm", "spec_digest": "ab" * 32, "regime": "pretraining"}
    env = {**unchecked[0]["env"], "rng": {"seed": 1, "kind": "philox"}, "anything": [1, "a"]}
    assert verify(_root(unchecked, experiment=experiment, env=env)).ok


def test_close_fields(unchecked: Records) -> None:
    close = at(unchecked, "close")
    rejected(edited(unchecked, close, steps=5), "count_mismatch", close, "steps")
    rejected(edited(unchecked, close, checks=1), "count_mismatch", close, "checks")
    final = {**unchecked[close]["final"], "o": b"\x02" * 32}
    rejected(edited(unchecked, close, final=final), "state_discontinuity", close, "final.o")


# --- per-step hyperparameters (hp, Torch) -----------------------------------------------

GROUPS = [{"lr": 0.1, "betas": [0.9, 0.999], "weight_decay": 0.01, "foreach": None}, {"lr": 0.2}]


def _with_hp(records: Records, hp: Any, groups: Any = GROUPS) -> Records:
    env = {**records[0]["env"]}
    if groups is not None:
        env["optimizer"] = {"contract": "AdamW", "groups": groups}
    out = _root(records, env=env)
    return [
        {**r, "hp": hp} if r["t"] == "step" else r
        for r in out  # every step carries it, as a scheduler run does
    ]


def test_hp_per_group_is_accepted(unchecked: Records) -> None:
    hp = [{"lr": 0.05, "betas": [0.9, 0.99], "weight_decay": 0}, {"lr": 0.1}]
    assert verify(_with_hp(unchecked, hp)).ok
    assert verify(_with_hp(unchecked, [{}, {}])).ok
    # Without a group list in the root only the shape is checked.
    assert verify(_with_hp(unchecked, [{"lr": 1e-3}], groups=None)).ok


@pytest.mark.parametrize(
    ("hp", "words"),
    [
        ({"lr": 0.1}, "list of at most 1024"),
        ([{"lr": 0.1}], "has 1 groups; the root's env.optimizer.groups records 2"),
        ([{"lr": 0.1}, {"momentum": 0.9}], "group 1: option 'momentum' is not among"),
        ([{"lr": math.nan}, {}], "group 0: option 'lr' must be a finite number"),
        ([{"lr": math.inf}, {}], "finite number"),
        ([{"lr": True}, {}], "finite number"),
        ([{"lr": "0.1"}, {}], "finite number"),
        ([{"betas": [0.9] * 17}, {}], "at most 16"),
        ([{"betas": [0.9, [0.9]]}, {}], "finite number"),
        ([{"betas": [0.9, math.nan]}, {}], "finite number"),
        ([{1: 0.1}, {}], "is not text"),
        ([[0.1], {}], "group 0 must be a map"),
    ],
)
def test_hp_shape_is_checked(unchecked: Records, hp: Any, words: str) -> None:
    message = rejected(_with_hp(unchecked, hp), "schema", at(unchecked, "step", 0), "hp")
    assert words in message


def test_hp_group_count_is_bounded_without_a_group_list(unchecked: Records) -> None:
    message = rejected(
        _with_hp(unchecked, [{}] * 1025, groups=None), "schema", at(unchecked, "step", 0), "hp"
    )
    assert "at most 1024" in message


# --- committed gradients (schema.grad, config.bounds, step.grad) ----------------------------


@pytest.fixture(scope="module")
def with_gradients(tmp_path_factory: pytest.TempPathFactory) -> Records:
    """6 steps committing their gradients, no sampled checks."""
    return _write(
        tmp_path_factory.mktemp("gradients"),
        steps=6,
        snapshot_interval=3,
        sampling=NO_CHECKS,
        gradients=True,
    )


def test_a_run_that_commits_gradients_verifies_with_its_probes(tmp_path: Path) -> None:
    path = tmp_path / "proof"
    write_synthetic_transcript(path, steps=5, gradients=True)
    report = verify_transcript(path)
    assert report.ok, report.summary()
    root = report.root
    assert root["config"]["bounds"] == {"tensor": 1e-4, "total": 2e-5, "scale": 1e-5}
    assert [leaf["path"] for leaf in root["schema"]["grad"]] == ["params:b", "params:w"]


def test_gradients_and_bounds_come_together(with_gradients: Records) -> None:
    root = with_gradients[0]
    config = {k: v for k, v in root["config"].items() if k != "bounds"}
    rejected(edited(with_gradients, 0, config=config), "schema", 0, "config")
    schema = {k: v for k, v in root["schema"].items() if k != "grad"}
    rejected(edited(with_gradients, 0, schema=schema), "schema", 0, "config.bounds")


@pytest.mark.parametrize(
    ("leaf", "words"),
    [
        ({"path": "w", "dtype": "float32", "shape": [6, 1]}, "must be named"),
        ({"path": "params:x", "dtype": "float32", "shape": [6, 1]}, "does not name a params leaf"),
        ({"path": "params:w", "dtype": "float64", "shape": [6, 1]}, "same dtype and shape"),
        ({"path": "params:w", "dtype": "float32", "shape": [1, 6]}, "same dtype and shape"),
        ({"path": "buffers:w", "dtype": "float32", "shape": [6, 1]}, "does not name a buffers"),
    ],
)
def test_computed_leaves_name_state_leaves(with_gradients: Records, leaf: Any, words: str) -> None:
    root = with_gradients[0]
    schema = {**root["schema"], "grad": [root["schema"]["grad"][0], leaf]}
    assert words in rejected(edited(with_gradients, 0, schema=schema), "schema", 0, "schema.grad")
    twice = {**root["schema"], "grad": [root["schema"]["grad"][0]] * 2}
    assert "twice" in rejected(edited(with_gradients, 0, schema=twice), "schema", 0)


@pytest.mark.parametrize("bounds", [{"tensor": 1.0, "total": 0, "scale": 0}, {"tensor": 0.1}])
def test_the_bounds_have_their_fields_and_ranges(with_gradients: Records, bounds: Any) -> None:
    root = with_gradients[0]
    config = {**root["config"], "bounds": bounds}
    rejected(edited(with_gradients, 0, config=config), "schema", 0)


def test_every_step_commits_its_computed_values(
    with_gradients: Records, unchecked: Records
) -> None:
    index = at(with_gradients, "step", 2)
    step = {k: v for k, v in with_gradients[index].items() if k != "grad"}
    out = list(with_gradients)
    out[index] = step
    rejected(out, "schema", index, "grad")
    rejected(edited(with_gradients, index, grad=b"short"), "schema", index, "grad")
    # And none in a run that does not declare them.
    index = at(unchecked, "step", 2)
    rejected(edited(unchecked, index, grad=bytes(32)), "schema", index, "grad")


def test_the_probe_block_holds_the_gradient_probes(with_gradients: Records) -> None:
    first = with_gradients[at(with_gradients, "step", 0)]
    specs = tuple(LeafSpec.from_dict(leaf) for leaf in with_gradients[0]["schema"]["params"])
    assert first["probe"]["len"] == 4 * 4 * _probe_floats(specs, 0.5)
