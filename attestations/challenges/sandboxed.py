"""The platform's replays, each in a sandboxed child process (:mod:`provers.sandbox`).

The tasks never run a lab's program in their own process (issue 59): a whole-step
replay (:func:`replay`) and a slice's check (:func:`verify_slice`) copy what they read
into a private read-only folder and run in a child with no secrets, no network and
resource limits. What the child must not see is :func:`hidden_paths`: the data
directory (database, keys, blobs) and every key file the settings name. With tasks run
eagerly (the embedded default), the web process starts the child; the child, not the
web worker, runs the program.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.conf import settings

from attestations.challenges.index import FILES_DIR, PROBES, TRANSCRIPT
from provers.sandbox import CompileCache, Limits, SandboxError, run
from zkdv.files import program_file

__all__ = [
    "SandboxError",
    "compile_cache",
    "hidden_paths",
    "replay",
    "replay_environment",
    "verify_slice",
]


def hidden_paths() -> list[str]:
    """The platform's folders and key files a replay child must not read.

    The data directory holds the SQLite database, the generated secret key, the signing,
    challenge and TSA keys (``keys/``) and the blobs; key files may also be mounted
    secrets elsewhere (``DVBENCH_SIGNING_KEY_FILE``, ``DVBENCH_CHALLENGE_KEY_FILE``).
    """
    dvbench = settings.DVBENCH
    paths = [Path(dvbench["DATA_DIR"]), Path(settings.BASE_DIR) / ".data"]
    for value in (dvbench["SIGNING_KEY_FILE"], dvbench["CHALLENGE_KEY_FILE"]):
        if value:
            paths.append(Path(value))
    return list(dict.fromkeys(str(p.resolve()) for p in paths if p.exists()))


def compile_cache(program: Path | None) -> CompileCache | None:
    """The compiled programs a replay of ``program`` may reuse (an ``aot-inductor`` run's
    archive, compiled by the replay itself): ``<DATA_DIR>/compiled``, by its SHA-256."""
    if program is None:
        return None
    return CompileCache.for_program(Path(settings.DVBENCH["DATA_DIR"]) / "compiled", program)


def _limits() -> Limits:
    # The parent gives up a little before Celery's soft limit, so the task records why.
    return Limits.from_environment(wall_seconds=max(5, settings.CELERY_TASK_SOFT_TIME_LIMIT - 5))


def _proof_files(directory: Path, needed: Iterable[str]) -> dict[str, Path]:
    """The files a replay reads: the transcript, the probe file (the committed probes it
    compares), the challenge's files, and the empty trees' files."""
    wanted = {TRANSCRIPT, PROBES, *needed}
    files: dict[str, Path] = {}
    for path in directory.rglob("*"):
        if not path.is_file() or path.name.endswith(".partial"):
            continue
        name = path.relative_to(directory).as_posix()
        empty_tree = name.startswith(f"{FILES_DIR}/") and path.stat().st_size == 0
        if name in wanted or empty_tree:
            files[name] = path
    return files


def replay(
    directory: Path, needed: Iterable[str], step: int, through: int | None
) -> dict[str, Any]:
    """Replay one whole-step challenge of the proof in ``directory``; the verdict's dict.

    Raises:
        provers.sandbox.SandboxError: no verdict came back (the task records an error).
    """
    inputs = _proof_files(directory, needed)
    verdict = run(
        "replay",
        {"step": step, "through": through},
        inputs=inputs,
        hide=hidden_paths(),
        limits=_limits(),
        cache=compile_cache(inputs.get(program_file("aot-inductor"))),
    )
    evidence = verdict.get("evidence")
    if not isinstance(evidence, list) or not all(isinstance(e, dict) for e in evidence):
        raise SandboxError("the replay verdict's 'evidence' is not a list of objects")
    for key in ("reason", "message"):
        if not isinstance(verdict.get(key), str | None):
            raise SandboxError(f"the replay verdict's {key!r} is not a string")
    return verdict


@functools.cache
def replay_environment(prover: str) -> dict[str, Any]:
    """Where this worker replays with ``prover`` (a module of :mod:`provers`): its
    ``environment()``, read in a child, once per worker process.

    Read in a child because reading it opens the framework's backend, and an accelerator
    opened by this process would be held by it: on a TPU host (one program per chip)
    the replay child could then not open the chip. The answer does not change while the
    worker lives.

    Raises:
        provers.sandbox.SandboxError: no answer came back.
    """
    answer = run(
        "environment", {"prover": prover}, inputs={}, hide=hidden_paths(), limits=_limits()
    )
    environment = answer.get("environment")
    if not isinstance(environment, dict):
        raise SandboxError("the replay environment is not an object")
    return environment


def verify_slice(arguments: dict[str, Any], inputs: dict[str, Path | bytes]) -> dict[str, Any]:
    """Check one slice (:func:`provers.sandbox_jobs.verify_slice`); the verdict's dict.

    Raises:
        provers.sandbox.SandboxError: no verdict came back, or a malformed one.
    """
    verdict = run("slice", arguments, inputs=inputs, hide=hidden_paths(), limits=_limits())
    for key, kind in (("reason", str), ("message", str), ("margins", dict)):
        if not isinstance(verdict.get(key), kind):
            raise SandboxError(f"the slice verdict's {key!r} is not a {kind.__name__}")
    if not isinstance(verdict.get("seconds"), int | float):
        raise SandboxError("the slice verdict's 'seconds' is not a number")
    return verdict
