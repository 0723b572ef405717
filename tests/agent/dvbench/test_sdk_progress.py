"""The progress line, and what importing dvbench costs (no Django, no framework)."""

from __future__ import annotations

import io
import subprocess
import sys

from dvbench._progress import Progress, format_bytes


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_it_draws_bytes_rate_and_dedup_on_a_terminal():
    stream = Terminal()
    bar = Progress(3 * 1024 * 1024, stream=stream)
    bar.add(1024 * 1024)
    bar.dedup(1024 * 1024)
    bar.skip(512 * 1024)
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n")
    last = text.rstrip("\n").rsplit("\r", 1)[1]
    assert "2.5 MiB / 3.0 MiB (83%)" in last
    assert "B/s" in last and "dedup 1.0 MiB in 1 file(s)" in last
    assert "resumed 512.0 KiB" in last and "done" in last


def test_it_stays_quiet_when_stderr_is_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(100, stream=stream)
    bar.add(100)
    bar.close()
    assert stream.getvalue() == ""


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"


def test_importing_dvbench_imports_no_django_and_no_framework():
    code = (
        "import sys, dvbench, dvbench._cli\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'django', 'jax', 'torch', 'flax'}\n"
        "print(sorted(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
