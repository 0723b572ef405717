"""Property-based tamper tests: every edit of a valid transcript is rejected with its reason.

The honest transcript is a function of its arguments (``tests/synthetic.py`` fixes the clock,
the probe seed and the environment), so the only randomness here is hypothesis' draws
and a failure replays from its seed (``pytest --hypothesis-seed=N``,
``scripts/test-repeat``). ``DVBENCH_FUZZ_EXAMPLES`` scales the number of examples.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.reliability.fuzz import budget
from tests.synthetic import write_synthetic_transcript
from zkdv.config import SamplingPolicy
from zkdv.hashing import ZERO_DIGEST, Domain, hash_bytes
from zkdv.records import RECORDS_FILE, encode, iter_records, record_hash
from zkdv.verify import verify_transcript

# 150 examples a property at the default budget of 60.
FUZZ = budget(2.5)


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("honest")
    write_synthetic_transcript(path, steps=6, experiment="acme/lm", spec_digest="ab" * 32)
    return path


@pytest.fixture(scope="module")
def data(honest: Path) -> bytes:
    return (honest / RECORDS_FILE).read_bytes()


def _records(data: bytes) -> list[dict[str, Any]]:
    return [r.data for r in iter_records(data)]


def _boundaries(data: bytes) -> list[tuple[int, int]]:
    return [(r.offset, r.offset + r.size) for r in iter_records(data)]


def rechain(records: list[dict[str, Any]]) -> bytes:
    """What a forger does after an edit: recompute every prev so the chain is intact."""
    out = bytearray()
    prev = ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    return bytes(out)


def _verify(data: bytes, proof_dir: Path | None = None) -> Any:
    """Verify records alone, or written into ``proof_dir`` beside its probe sidecar."""
    if proof_dir is None:
        return verify_transcript(data, probes=False)
    (proof_dir / RECORDS_FILE).write_bytes(data)
    return verify_transcript(proof_dir)


def test_the_honest_transcript_is_valid(honest: Path) -> None:
    report = verify_transcript(honest)
    assert report.ok, report.summary()
    assert report.root is not None
    assert report.root["experiment"] == {"name": "acme/lm", "spec_digest": "ab" * 32}
    assert report.sampled == [0, 2, 4]


def test_the_honest_transcript_is_the_same_on_every_run(data: bytes, tmp_path: Path) -> None:
    # The property tests below are only replayable from their seed if their fixture is
    # a function of its arguments: no wall clock, no random probe seed, no machine facts.
    again = write_synthetic_transcript(
        tmp_path / "again", steps=6, experiment="acme/lm", spec_digest="ab" * 32
    )
    assert (again / RECORDS_FILE).read_bytes() == data


def test_rechaining_reproduces_the_honest_bytes(data: bytes) -> None:
    # Guards the forger's tool used below: an unedited re-chain is byte-identical.
    assert rechain(_records(data)) == data


@FUZZ
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_flipped_bit_is_rejected(data: bytes, position: int, bit: int) -> None:
    position %= len(data)
    tampered = bytearray(data)
    tampered[position] ^= 1 << bit
    report = _verify(bytes(tampered))
    assert not report.ok
    assert report.reason is not None and report.message


@FUZZ
@given(cut=st.integers(min_value=1))
def test_truncated_tails_are_reported_precisely(data: bytes, cut: int) -> None:
    # 1 .. len - 1: a multiple of the length used to wrap to 0, an empty file (found
    # with DVBENCH_FUZZ_EXAMPLES=5000; an empty transcript is its own case, "empty").
    cut = cut % (len(data) - 1) + 1
    report = _verify(data[:cut])
    boundaries = _boundaries(data)
    ends = {end for _, end in boundaries}
    if cut in ends:
        assert report.reason == "missing_close"
    else:
        assert report.reason == "truncated"
        inside = next(i for i, (start, end) in enumerate(boundaries) if start < cut < end)
        assert report.record == inside
        assert f"byte offset {boundaries[inside][0]}" in report.message


def _kinds(records: list[dict[str, Any]]) -> list[str]:
    return [r["t"] for r in records]


@FUZZ
@given(choice=st.data())
def test_dropped_duplicated_or_swapped_records_are_rejected(
    data: bytes, choice: st.DataObject
) -> None:
    records = _records(data)
    n = len(records)
    op = choice.draw(st.sampled_from(["drop", "duplicate", "swap"]))
    i = choice.draw(st.integers(min_value=1, max_value=n - 1))
    edited = list(records)
    if op == "drop":
        del edited[i]
    elif op == "duplicate":
        edited.insert(i, records[i])
    else:
        j = choice.draw(
            st.integers(min_value=1, max_value=n - 1).filter(lambda j: records[j] != records[i])
        )
        edited[i], edited[j] = edited[j], edited[i]
    raw = b"".join(encode(r) for r in edited)
    # Without re-chaining the chain breaks; with it, the structure does.
    assert not _verify(raw).ok
    report = _verify(rechain(edited))
    if report.ok:
        # The one accepted reordering is the protocol's own: a check completes
        # asynchronously, so it may follow later step records of the same run.
        assert op == "swap" and _legal_async_order(edited), (op, i, _kinds(records))
        return
    assert report.reason in {
        "step_order",
        "missing_check",
        "unexpected_check",
        "check_order",
        "snapshot_order",
        "missing_snapshot",
        "unexpected_snapshot",
        "state_discontinuity",
        "count_mismatch",
        "after_close",
        "missing_close",
        "missing_root",
        "altered_check",
    }


def _legal_async_order(records: list[dict[str, Any]]) -> bool:
    """Steps in order, each snapshot between the step before it and its own, and each
    check after its step: what the protocol allows a writer whose checks complete late."""
    steps = [r["i"] for r in records if r["t"] == "step"]
    seen: set[int] = set()
    for record in records:
        kind, step = record["t"], record.get("i")
        if kind == "step":
            seen.add(step)
            continue
        early_check = kind == "check" and step not in seen
        misplaced_snapshot = kind == "snap" and (step in seen or step - 1 not in seen | {-1})
        if early_check or misplaced_snapshot:
            return False
    return steps == sorted(steps) and len(steps) == len(set(steps))


def test_duplicated_snapshot_record_is_rejected(data: bytes) -> None:
    # Found by the property test above: a repeated snapshot record once slipped through.
    records = _records(data)
    snap = next(i for i, r in enumerate(records) if r["t"] == "snap" and r["i"] == 4)
    edited = [*records[: snap + 1], records[snap], *records[snap + 1 :]]
    report = _verify(rechain(edited))
    assert (report.reason, report.record) == ("snapshot_order", snap + 1)
    assert "recorded twice" in report.message


def test_rechained_edit_of_a_sampled_decision_is_rejected(data: bytes) -> None:
    records = _records(data)
    # Editing any committed field of a sampled step changes its record hash and so the
    # challenged coordinates the verifier derives from it.
    step = next(i for i, r in enumerate(records) if r["t"] == "step" and r["i"] == 2)
    edited = list(records)
    edited[step] = {**records[step], "tokens": records[step]["tokens"] + 1}
    report = _verify(rechain(edited))
    assert (report.ok, report.reason) == (False, "altered_check")
    assert "the transcript sampled" in report.message


def test_rechained_forged_check_values_are_rejected(data: bytes) -> None:
    records = _records(data)
    check = next(i for i, r in enumerate(records) if r["t"] == "check")
    forged = dict(records[check])
    forged["param"] = {**forged["param"], "replayed": forged["param"]["committed"] + 1.0}
    edited = list(records)
    edited[check] = forged  # still claims ok=True
    report = _verify(rechain(edited))
    assert (report.reason, report.field) == ("altered_check", "ok")
    edited[check] = {**forged, "ok": False}
    report = _verify(rechain(edited))
    assert report.reason == "failed_check"
    assert report.record == check


def test_rechained_skipped_check_is_rejected(data: bytes) -> None:
    records = [r for r in _records(data) if not (r["t"] == "check" and r["i"] == 4)]
    report = _verify(rechain(records))
    assert report.reason == "missing_check"
    assert "step 4 was sampled" in report.message


def test_program_or_config_change_mid_run_is_rejected(data: bytes) -> None:
    records = _records(data)
    step = next(i for i, r in enumerate(records) if r["t"] == "step" and r["i"] == 3)
    edited = list(records)
    edited[step] = {
        **records[step],
        "program": {"kind": "jax.export", "digest": b"x" * 32, "bytes": 1},
    }
    report = _verify(rechain(edited))
    assert (report.reason, report.field) == ("program_changed", "program")


def test_state_root_that_does_not_continue_is_rejected(data: bytes) -> None:
    records = _records(data)
    snap = next(i for i, r in enumerate(records) if r["t"] == "snap" and r["i"] == 2)
    edited = list(records)
    edited[snap] = {**records[snap], "roots": {**records[snap]["roots"], "p": b"\x01" * 32}}
    report = _verify(rechain(edited))
    assert (report.reason, report.field) == ("state_discontinuity", "roots.p")


def test_probe_sidecar_is_bound_by_digest(honest: Path, tmp_path: Path) -> None:
    shutil.copytree(honest, tmp_path / "p")
    probes = bytearray((tmp_path / "p" / "probes.bin").read_bytes())
    probes[-1] ^= 0x40
    (tmp_path / "p" / "probes.bin").write_bytes(bytes(probes))
    report = verify_transcript(tmp_path / "p")
    assert (report.reason, report.field) == ("probe_digest", "probe.digest")


def test_probe_discontinuity_is_rejected(honest: Path, data: bytes, tmp_path: Path) -> None:
    # Parameters modified outside the step: step 3's pre-update probe no longer continues
    # step 2's post-update probe. A forger who rewrites the sidecar and re-binds its
    # digest consistently is still caught by the continuity check.
    shutil.copytree(honest, tmp_path / "p")
    records = _records(data)
    index = next(i for i, r in enumerate(records) if r["t"] == "step" and r["i"] == 3)
    probe = records[index]["probe"]
    raw = bytearray((tmp_path / "p" / "probes.bin").read_bytes())
    block = (
        np.frombuffer(bytes(raw[probe["off"] : probe["off"] + probe["len"]]), "<f4")
        .reshape(3, -1)
        .copy()
    )
    block[0, 0] += 0.5  # pre
    block[1, 0] += 0.5  # post = pre + delta still holds
    raw[probe["off"] : probe["off"] + probe["len"]] = block.tobytes()
    (tmp_path / "p" / "probes.bin").write_bytes(bytes(raw))
    edited = list(records)
    edited[index] = {
        **records[index],
        "probe": {**probe, "digest": hash_bytes(Domain.PROBE, block.tobytes())},
    }
    report = _verify(rechain(edited), tmp_path / "p")
    assert (report.reason, report.record) == ("probe_discontinuity", index)
    assert "do not continue the post-update parameters of step 2" in report.message


def test_wrong_sampling_policy_is_not_a_way_out(data: bytes) -> None:
    # Lowering the sampling probability in the root changes every decision: the checks
    # recorded under the real policy no longer match.
    records = _records(data)
    root = dict(records[0])
    root["config"] = {
        **root["config"],
        "sampling": SamplingPolicy(update_check_probability=0.0).to_dict(),
    }
    report = _verify(rechain([root, *records[1:]]))
    assert report.reason == "unexpected_check"
