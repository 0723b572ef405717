"""Processes a test starts and waits for, their output in files, never in pipes.

A child writing to a pipe that nobody is reading blocks once the pipe's 64 KiB are full.
Tests that start several processes and then read them one at a time left the later ones
blocked on their output meanwhile, or, where the processes wait for each other (ranks of
one distributed run), deadlocked until a timeout (issue 58). Here each process writes
to files in a folder the test owns (its ``tmp_path``, which pytest keeps after the run),
all are waited for under one deadline, and whatever is still running at the end, or when
the test fails, is killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sources import AGENT_PYTHONPATH

#: How much of a process's output a failure shows.
TAIL_CHARACTERS = 3000


@dataclass(frozen=True)
class Started:
    """A process that :func:`start` started, and the files that hold its output."""

    name: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    #: None when stderr goes to ``stdout_path`` too.
    stderr_path: Path | None

    def stdout(self) -> str:
        """Everything the process wrote to stdout (and stderr, when they were merged)."""
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        """Everything the process wrote to stderr; empty when it went to stdout."""
        return "" if self.stderr_path is None else self.stderr_path.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def tail(self) -> str:
        """The end of its output, for an assertion's message."""
        text = self.stdout() + self.stderr()
        return f"{self.name} (output in {self.stdout_path.parent}):\n{text[-TAIL_CHARACTERS:]}"


def start(
    command: Sequence[str], *, folder: Path, name: str, merge: bool = False, **options: Any
) -> Started:
    """Start ``command`` with its stdout in ``folder/name.out`` and its stderr in
    ``folder/name.err`` (or in ``name.out`` too, with ``merge``); ``options`` go to Popen.
    """
    folder.mkdir(parents=True, exist_ok=True)
    stdout_path = folder / f"{name}.out"
    stderr_path = None if merge else folder / f"{name}.err"
    with contextlib.ExitStack() as files:
        stdout = files.enter_context(stdout_path.open("wb"))
        stderr = files.enter_context(stderr_path.open("wb")) if stderr_path else subprocess.STDOUT
        # The child holds its own copies of the descriptors: ours close at once.
        process = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, **options
        )
    return Started(name, process, stdout_path, stderr_path)


def wait_all(started: Sequence[Started], timeout: float) -> None:
    """Wait for every process, all within ``timeout`` seconds.

    Past the deadline the test fails naming the processes still running, with the end of
    their output; they are killed, and so is every one still running when this returns
    or raises (the test failed or was interrupted).
    """
    deadline = time.monotonic() + timeout
    try:
        for each in started:
            try:
                each.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [s for s in started if s.process.poll() is None]
                pytest.fail(
                    f"still running after {timeout:.0f} s: "
                    + "\n\n".join(s.tail() for s in running)
                )
    finally:
        for each in started:
            if each.process.poll() is None:
                each.process.kill()
                each.process.wait()


def run_jax(
    args: Sequence[str | Path],
    *,
    folder: Path,
    name: str,
    xla_flags: str,
    pythonpath: Sequence[str | Path] = (),
    cpus: Sequence[int] | None = None,
    timeout: float = 420,
) -> str:
    """Run a JAX program (``python args...``) to its end in a fresh process; its stdout.

    The process gets ``XLA_FLAGS`` (the kernel family, the host's device count), the
    agent's sources and ``pythonpath`` to import, its programs exported for this machine
    alone (``ZKDV_JAX_EXPORT_PLATFORMS`` empty), and only ``cpus`` when given (XLA's
    thread pool is sized by them). Its output goes to ``folder/name.out`` and ``.err``;
    a non-zero exit fails the test with their end.
    """
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags,
        "PYTHONPATH": os.pathsep.join([AGENT_PYTHONPATH, *map(str, pythonpath)]),
        "ZKDV_JAX_EXPORT_PLATFORMS": "",
    }
    command = [sys.executable, *map(str, args)]
    if cpus is not None:
        command = ["taskset", "--cpu-list", ",".join(map(str, cpus)), *command]
    started = start(command, folder=folder, name=name, env=env)
    wait_all([started], timeout)
    assert started.returncode == 0, started.tail()
    return started.stdout()
