"""docs/performance.md is what the stored bench runs render, and covers every bench."""

from __future__ import annotations

from pathlib import Path

from tests.bench_modules import BENCH, load

report = load("report")


def test_every_bench_is_in_the_report() -> None:
    # A module whose name begins with "_" is a helper the benches import (the floors, the
    # JAX forgers), not a bench; report.py is the report itself.
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    scripts -= {"report"}
    listed = {bench.name for bench in report.BENCHES}
    assert scripts - listed == set(), "benches the report does not run"
    assert listed - scripts == set(), "the report names benches that do not exist"


def test_the_page_is_what_the_stored_runs_render() -> None:
    # Hand edits, or a run whose page was not rewritten, fail here: scripts/bench-report
    # --render rewrites it.
    assert report.PAGE.read_text() == report.render(report.load())


def test_each_stored_run_ran_its_bench_s_present_command() -> None:
    # A bench whose arguments changed must be run again before its figures are shown.
    store = report.load()
    for bench in report.BENCHES:
        entry = store.get(bench.name)
        if entry is not None:
            assert entry["command"] == bench.command, bench.name


def test_a_run_keeps_its_output_and_a_failure_is_shown_as_one(tmp_path: Path) -> None:
    bench = report.Bench("probe_cost", ("--definitely-not-an-option",), "m", "f")
    entry = report.run(bench)
    assert entry["returncode"] == 2 and entry["command"].endswith("--definitely-not-an-option")
    assert any("unrecognized arguments" in line for line in entry["output"])
    assert report.headlines(entry)[0].startswith("failed (exit 2)")
    # A bench that exits 1 on a target it misses keeps its figures.
    missed = {**entry, "returncode": 1, "output": ["  upload/copy 0.13 (target >= 0.4) FAIL"]}
    assert report.headlines(missed) == [
        "upload/copy 0.13 (target >= 0.4) FAIL",
        "exit 1: a target not met",
    ]
    page = report.render({"probe_cost": entry})
    assert "failed (exit 2)" in page and "not run yet" in page
