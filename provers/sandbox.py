"""Replays run in a sandboxed child process: no secrets, no network, bounded, read-only.

A replay runs a lab's program. :mod:`zkdv.untrusted` refuses what could run the lab's
code at load time, and this module bounds what a replay can reach if anything ever
does (``docs/reliability.md``, "Threat model"). :func:`run` is the parent's side:

* the inputs (the proof's files, or a slice's run file, programs and opening) are
  copied into a private temporary directory, files mode 0444 and folders 0555; it is
  the child's working directory, and a scratch folder beside it is its ``HOME`` and
  ``TMPDIR``;
* the child is a fresh interpreter (``python -E -s -P``: no ``PYTHON*`` variables, no
  user site, no working directory on ``sys.path``) started with an environment built
  from an allow-list (:func:`child_environment`): no ``SECRET_KEY``, database or broker
  URL, signing, challenge or TSA key, no storage credentials; every descriptor but its
  pipes is closed;
* its verdict comes back as JSON over a pipe of its own (not its stdout, which Torch
  and JAX may write to), at most :data:`MAX_VERDICT` bytes, and the parent checks its
  shape before the caller records it.

The child's side (:func:`child`) first isolates itself, while it is still one thread:
a new user, mount and network namespace (``unshare``; only a loopback device, so no
network), the platform's data directory and key files hidden under empty mounts, the
inputs re-mounted read-only; then resource limits (``RLIMIT_AS``, ``RLIMIT_CPU``,
``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``). Where the kernel refuses namespaces (a container
without user namespaces), the child carries on without them and says so in the
verdict's ``sandbox`` notes; the replay worker's own user and volumes (``compose.yaml``)
are then what keep the keys out of reach. Then it runs one job of
:mod:`provers.sandbox_jobs` and writes its verdict.

Starting a child costs an interpreter and the framework's import (2-4 s); a replay of a
real model costs far more, and a program is loaded once per child. A program the replay
compiles (``aot-inductor``) may come from a :class:`CompileCache`: the parent copies the
entries of that program's digest into the child's scratch and keeps what it compiled.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "MAX_VERDICT",
    "CompileCache",
    "Limits",
    "SandboxError",
    "child",
    "child_environment",
    "run",
]

#: The largest verdict a child may send back.
MAX_VERDICT = 16 * 1024**2
#: Environment variables a replay may see: locale, search path, and the settings of the
#: numerical libraries that change a replay's bits or threads. Nothing else passes.
KEPT = frozenset({"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ"})
KEPT_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "XLA_", "JAX_", "TPU_", "CUDA_", "NVIDIA_")
#: Names that are never passed, even under a kept prefix.
SECRET = re.compile(
    r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|DATABASE|REDIS|BROKER|AWS|S3|TSA|SIGNING|_URL$",
    re.IGNORECASE,
)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


class SandboxError(RuntimeError):
    """The sandboxed replay broke (not the lab's fault): no verdict came back."""


@dataclass(frozen=True)
class CompileCache:
    """Programs compiled by earlier children, which a child may reuse (``ZKDV_AOTI_CACHE``).

    The child sees copies of the entries named ``<prefix>*.pt2`` in a folder of its
    scratch, never the cache itself; after it exits, the parent keeps the entries it
    wrote or replaced there. The prefix is the program's SHA-256, so an entry only ever
    serves replays of the same program bytes (an entry a compromised child left is run
    by later children of that program, in the same sandbox, and nowhere else).

    Attributes:
        folder: the platform's cache folder (outside anything a child can see).
        prefix: ``<sha256 of the program file>-``.
        max_bytes: the largest entry kept.
    """

    folder: Path
    prefix: str
    max_bytes: int = 1024**3

    @classmethod
    def for_program(cls, folder: Path, program: Path) -> CompileCache:
        """The entries of ``folder`` that serve the program in the file ``program``."""
        return cls(folder, f"{_sha256(program).hex()}-")

    def lend(self, scratch: Path) -> tuple[Path, dict[str, bytes]]:
        """Copy this program's entries into the child's scratch; what was lent."""
        target = scratch / "compiled"
        target.mkdir(mode=0o700)
        lent: dict[str, bytes] = {}
        if self.folder.is_dir():
            for entry in self.folder.glob(f"{self.prefix}*.pt2"):
                if entry.is_file() and not entry.is_symlink():
                    shutil.copyfile(entry, target / entry.name)
                    lent[entry.name] = _sha256(entry)
        return target, lent

    def keep(self, target: Path, lent: Mapping[str, bytes]) -> list[str]:
        """Keep the entries the child compiled (new or replaced); their names."""
        kept = []
        for entry in sorted(target.glob(f"{self.prefix}*.pt2")):
            if entry.is_symlink() or not entry.is_file():
                continue
            if entry.stat().st_size > self.max_bytes or lent.get(entry.name) == _sha256(entry):
                continue
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / f".{entry.name}.{os.getpid()}.partial"
            shutil.copyfile(entry, partial)
            os.replace(partial, self.folder / entry.name)
            kept.append(entry.name)
        return kept


def _sha256(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


@dataclass(frozen=True)
class Limits:
    """What one replay child may use (``DVBENCH_REPLAY_*`` in the environment).

    Attributes:
        memory_bytes: address space (``RLIMIT_AS``).
        cpu_seconds: CPU time (``RLIMIT_CPU``); the parent also kills it after
            ``wall_seconds``.
        file_bytes: the largest file it may write (``RLIMIT_FSIZE``).
        open_files: descriptors (``RLIMIT_NOFILE``).
        wall_seconds: how long the parent waits for the verdict.
    """

    memory_bytes: int = 64 * 1024**3
    cpu_seconds: int = 4 * 3600
    file_bytes: int = 1024**3
    open_files: int = 1024
    wall_seconds: float = 3600.0

    @classmethod
    def from_environment(cls, wall_seconds: float | None = None) -> Limits:
        """The limits the operator set, else the defaults.

        Raises:
            ValueError: a ``DVBENCH_REPLAY_*`` value that is not a positive integer.
        """
        values: dict[str, Any] = {}
        for name in ("memory_bytes", "cpu_seconds", "file_bytes", "open_files"):
            key = f"DVBENCH_REPLAY_{name.upper()}"
            text = os.environ.get(key, "").strip()
            if text:
                if not text.isdigit() or int(text) <= 0:
                    raise ValueError(f"{key} must be a positive integer, not {text!r}")
                values[name] = int(text)
        if wall_seconds is not None:
            values["wall_seconds"] = float(wall_seconds)
        return cls(**values)


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a replay child gets: the allow-list, minus anything secret."""
    source = os.environ if environ is None else environ
    kept = {
        name: value
        for name, value in source.items()
        if (name in KEPT or name.startswith(KEPT_PREFIXES)) and not SECRET.search(name)
    }
    kept.setdefault("PATH", "/usr/bin:/bin")
    return kept


def _search_path() -> list[str]:
    """Where the child finds ``provers`` and ``zkdv`` (the venv's site comes by itself)."""
    import zkdv

    folders = [Path(__file__).resolve().parents[1], Path(zkdv.__file__).resolve().parents[1]]
    return list(dict.fromkeys(str(f) for f in folders))


#: The child's first statements. It loads this file alone, by its path, not the
#: ``provers`` package: that imports numpy, whose BLAS starts threads, and a process with
#: threads may not enter a new user namespace. Isolation comes before any such import.
_BOOT = (
    "import sys, json, importlib.util as u; sys.path[:0] = json.loads(sys.argv[1]); "
    "spec = u.spec_from_file_location('_dvbench_sandbox', sys.argv[2]); "
    "module = sys.modules[spec.name] = u.module_from_spec(spec); "
    "spec.loader.exec_module(module); module.child()"
)


def _place(inputs: Mapping[str, Path | bytes], folder: Path) -> None:
    """Copy the inputs under ``folder``: files 0444, folders 0555 (read-only)."""
    for name, source in inputs.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"sandbox input {name!r} is not a relative path")
        target = folder.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, bytes | bytearray | memoryview):
            target.write_bytes(bytes(source))
        else:
            # A copy, never a link: the child must not reach the cache's own file.
            shutil.copyfile(source, target)
        target.chmod(0o444)
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_dir():
            path.chmod(0o555)
    folder.chmod(0o555)


def _remove(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.chmod(0o700)
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _workspace() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dvbench-replay-"))
    try:
        root.chmod(0o700)
        yield root
    finally:
        _remove(root)


def _read_verdict(descriptor: int, process: subprocess.Popen[bytes], deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxError("the replay ran past its wall-clock limit")
        ready, _, _ = select.select([descriptor], [], [], min(remaining, 1.0))
        if not ready:
            continue
        chunk = os.read(descriptor, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_VERDICT:
            raise SandboxError(f"the replay's verdict is over {MAX_VERDICT} bytes")
        chunks.append(chunk)


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        data = path.read_bytes()[-2000:]
        return data.decode("utf-8", "replace").strip()
    return ""


def run(
    job: str,
    arguments: Mapping[str, Any],
    *,
    inputs: Mapping[str, Path | bytes],
    hide: list[str] | tuple[str, ...] = (),
    network: bool = False,
    limits: Limits | None = None,
    cache: CompileCache | None = None,
) -> dict[str, Any]:
    """Run one job of :mod:`provers.sandbox_jobs` in a sandboxed child; its verdict.

    Args:
        job: the job's name (:data:`provers.sandbox_jobs.JOBS`).
        arguments: its JSON arguments; paths in them are relative to the inputs.
        inputs: relative name -> the file (or bytes) the child reads, copied read-only.
        hide: folders and files of the platform (its data directory, key files) to
            hide from the child under empty mounts.
        network: let the child keep the network. No replay needs it (a slice read
            through a lab's grant is fetched by the parent); for an operator's checks.
        limits: resource limits; by default :meth:`Limits.from_environment`.
        cache: compiled programs the child may reuse, and keeps what it compiles.

    Returns:
        The job's verdict (a JSON object) with ``sandbox``: notes on the isolation the
        kernel granted.

    Raises:
        SandboxError: the child died, ran out of time, or sent no well-formed verdict.
    """
    limits = limits or Limits.from_environment()
    with _workspace() as root:
        folder, scratch = root / "inputs", root / "scratch"
        folder.mkdir()
        scratch.mkdir(mode=0o700)
        _place(inputs, folder)
        environment = child_environment()
        environment.update(HOME=str(scratch), TMPDIR=str(scratch))
        lent: tuple[Path, dict[str, bytes]] | None = None
        if cache is not None:
            lent = cache.lend(scratch)
            environment["ZKDV_AOTI_CACHE"] = str(lent[0])
        request = {
            "job": job,
            "arguments": dict(arguments),
            "hide": [str(h) for h in hide],
            "network": network,
            "inputs": str(folder),
            "limits": asdict(limits),
        }
        reader, writer = os.pipe()
        # pass_fds keeps the descriptor's number in the child.
        request["fd"] = writer
        log = root / "child.log"
        try:
            process = _start(folder, environment, writer, log)
            os.close(writer)
            writer = -1
            verdict = _collect(process, reader, request, limits, log)
            if cache is not None and lent is not None:
                cache.keep(*lent)
            return verdict
        finally:
            if writer >= 0:
                os.close(writer)
            os.close(reader)


def _start(
    folder: Path, environment: dict[str, str], writer: int, log: Path
) -> subprocess.Popen[bytes]:
    """The child: a fresh interpreter in ``folder``, writing its verdict to ``writer``."""
    with open(log, "wb") as output:
        return subprocess.Popen(
            [
                sys.executable,
                *("-E", "-s", "-P", "-c", _BOOT),
                json.dumps(_search_path()),
                str(Path(__file__).resolve()),
            ],
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=output,
            env=environment,
            cwd=folder,
            close_fds=True,
            pass_fds=(writer,),
            start_new_session=True,
        )


def _collect(
    process: subprocess.Popen[bytes],
    reader: int,
    request: dict[str, Any],
    limits: Limits,
    log: Path,
) -> dict[str, Any]:
    deadline = time.monotonic() + limits.wall_seconds
    try:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(json.dumps(request).encode())
            process.stdin.close()
        data = _read_verdict(reader, process, deadline)
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SandboxError("the replay did not exit after sending its verdict") from None
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if code != 0 or not data:
        raise SandboxError(
            f"the replay process exited with status {code} and "
            f"{'a verdict' if data else 'no verdict'}: {_tail(log)[-800:]}"
        )
    try:
        verdict = json.loads(data)
    except ValueError as error:
        raise SandboxError(f"the replay's verdict is not JSON: {error}") from None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("ok"), bool):
        raise SandboxError("the replay's verdict is not an object with a boolean 'ok'")
    return verdict


# --- the child's side ------------------------------------------------------------------


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(libc: Any, flags: int) -> str | None:
    if libc.unshare(flags) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _isolate(request: dict[str, Any]) -> dict[str, Any]:
    """Namespaces and mounts, as far as the kernel allows; notes on what it granted."""
    notes: dict[str, Any] = {"namespaces": None, "hidden": [], "inputs_read_only": False}
    if not sys.platform.startswith("linux"):
        notes["namespaces"] = f"not isolated: {sys.platform} has no namespaces"
        return notes
    libc = _libc()
    network = 0 if request.get("network") else _CLONE_NEWNET
    uid, gid = os.getuid(), os.getgid()
    refused = _unshare(libc, _CLONE_NEWUSER | _CLONE_NEWNS | network)
    if refused is None:
        with contextlib.suppress(OSError):
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        notes["namespaces"] = "user, mount" + ("" if request.get("network") else ", network")
    else:
        # Without user namespaces a privileged worker can still take the other two.
        second = _unshare(libc, _CLONE_NEWNS | network)
        if second is not None:
            notes["namespaces"] = f"not isolated: unshare refused ({refused}; {second})"
            return notes
        notes["namespaces"] = "mount" + ("" if request.get("network") else ", network")
    notes["network"] = "kept (a grant's reads)" if request.get("network") else "none"
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        notes["mounts"] = f"refused: {os.strerror(ctypes.get_errno())}"
        return notes
    for path in request.get("hide") or []:
        # A folder that holds the inputs stays: hiding it would hide them too.
        inside = os.path.commonpath([path, str(request["inputs"])]) == path
        if not inside and _hide(libc, path):
            notes["hidden"].append(path)
    inputs = str(request["inputs"]).encode()
    if libc.mount(inputs, inputs, None, _MS_BIND | _MS_REC, None) == 0:
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        notes["inputs_read_only"] = libc.mount(None, inputs, None, flags, None) == 0
    return notes


def _hide(libc: Any, path: str) -> bool:
    """An empty tmpfs over a folder, or ``/dev/null`` over a file; whether it took."""
    if os.path.isdir(path):
        return bool(libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID, b"size=1m") == 0)
    if os.path.exists(path):
        return bool(libc.mount(b"/dev/null", path.encode(), None, _MS_BIND, None) == 0)
    return False


def _limit(limits: dict[str, Any]) -> None:
    import resource

    for kind, value in (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_CPU, limits["cpu_seconds"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
    ):
        _, hard = resource.getrlimit(kind)
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(kind, (value, value))


def child() -> None:
    """The child's entry point: read the request, isolate, limit, run the job, answer."""
    request = json.loads(sys.stdin.buffer.read(MAX_VERDICT))
    descriptor = int(request["fd"])
    notes = _isolate(request)
    _limit(request["limits"])
    os.chdir(request["inputs"])
    from provers.sandbox_jobs import JOBS

    verdict = JOBS[request["job"]](request["arguments"])
    verdict["sandbox"] = notes
    with os.fdopen(descriptor, "wb") as out:
        out.write(json.dumps(verdict).encode())
