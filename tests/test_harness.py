"""The suite's own machinery (issue 58): a hang fails within its limit, with every thread's
stack; processes a test starts never block on their output; the skipped tests are counted
by group at the end of the run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import skip_group
from tests.processes import start, wait_all

HANGING_TEST = textwrap.dedent(
    """
    import threading
    import time

    def stuck_helper():
        time.sleep(60)

    def test_hangs():
        threading.Thread(target=stuck_helper, name="stuck-helper", daemon=True).start()
        time.sleep(60)

    def test_after_the_hang():
        pass
    """
)


def test_a_hanging_test_fails_at_its_limit_with_every_threads_stack_and_the_run_goes_on(
    tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    assert float(pytestconfig.getini("timeout")) > 0
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:django",
            # The suite's method, with a limit short enough for a test.
            "-o",
            f"timeout_method={pytestconfig.getini('timeout_method')}",
            "-o",
            "timeout=2",
            "test_hang.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "1 failed, 1 passed" in output, output
    assert "Timeout (>2.0s)" in output, output
    # The other thread's stack, where it is stuck.
    assert "Stack of stuck-helper" in output and "in stuck_helper" in output, output
    assert time.monotonic() - started < 60


def test_processes_started_side_by_side_never_block_on_output_nobody_reads(
    tmp_path: Path,
) -> None:
    # Each writes 1 MiB to stdout and to stderr, sixteen pipes' worth, and nobody reads
    # until all have finished.
    code = "import sys; sys.stdout.write('o' * (1 << 20)); sys.stderr.write('e' * (1 << 20))"
    started = [
        start([sys.executable, "-c", code], folder=tmp_path, name=f"writer{n}") for n in range(3)
    ]
    wait_all(started, timeout=60)
    for process in started:
        assert process.returncode == 0
        assert process.stdout() == "o" * (1 << 20)
        assert process.stderr() == "e" * (1 << 20)


def test_processes_still_running_at_the_deadline_fail_the_test_and_are_killed(
    tmp_path: Path,
) -> None:
    quick = start([sys.executable, "-c", "print('done')"], folder=tmp_path, name="quick")
    stuck = start(
        [sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(60)"],
        folder=tmp_path,
        name="stuck",
        merge=True,
    )
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_all([quick, stuck], timeout=3)
    message = str(failed.value)
    assert "still running after 3 s: stuck" in message and "waiting" in message, message
    assert "quick" not in message
    assert stuck.process.poll() is not None  # killed, not left behind
    assert quick.returncode == 0 and quick.stdout() == "done\n"


def _skipped(reason: str, *markers: str) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid="tests/test_x.py::test_x",
        location=("tests/test_x.py", 0, "test_x"),
        keywords=dict.fromkeys(("test_x", *markers), 1),
        outcome="skipped",
        longrepr=("tests/test_x.py", 1, f"Skipped: {reason}"),
        when="setup",
    )


@pytest.mark.parametrize(
    ("reason", "markers", "group"),
    [
        ("needs real PostgreSQL and Redis: set DATABASE_URL and REDIS_URL", (), "services"),
        ("the append-only trigger exists on PostgreSQL only", (), "services"),
        ("fault tests run with the services (set DATABASE_URL and REDIS_URL)", (), "services"),
        ("DVBENCH_EAGER_TASKS is on, so tasks never leave the process", ("services",), "services"),
        ("needs Debian's Chromium at /usr/bin/chromium", ("browser",), "browser"),
        ("Sigstore's JavaScript verifier is not installed (node, npm ci)", (), "sigstore-js"),
        ("needs a CUDA device", (), "gpu"),
        ("no writable /dev/shm (tmpfs) on this machine", (), "other"),
    ],
)
def test_a_skip_is_counted_in_the_group_its_reason_or_marker_names(
    reason: str, markers: tuple[str, ...], group: str
) -> None:
    assert skip_group(_skipped(reason, *markers)) == group
