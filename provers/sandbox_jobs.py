"""What a sandboxed replay child runs (:mod:`provers.sandbox`): one job, one verdict.

Each job takes JSON arguments whose paths are relative to the child's working
directory (its read-only inputs) and returns a JSON verdict. No job imports Django or
reads a setting: the parent passes everything the job needs.

* ``replay``: a whole-step challenge (:func:`provers.verify_challenge` over the proof
  directory), the verdict :meth:`provers.replay.ReplayVerdict.to_dict`;
* ``slice``: one sliced challenge (:func:`provers.sliced.verify_slice` with the block's
  committed program), ``{ok, reason, message, margins, seconds}``;
* ``inspect``: what a replay can see and reach (its environment and resource limits,
  what it reads at the given paths, whether it can connect to an address, write beside its inputs),
  for the sandbox's own tests and an operator checking a deployment.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["JOBS", "environment", "inspect", "replay", "verify_slice"]


def replay(arguments: dict[str, Any]) -> dict[str, Any]:
    """Replay a challenged step (through ``through``) of the proof in the inputs."""
    import provers

    through = arguments.get("through")
    verdict = provers.verify_challenge(
        Path("."), int(arguments["step"]), through=None if through is None else int(through)
    )
    return verdict.to_dict()


def _failed(reason: str, message: str) -> dict[str, Any]:
    return {"ok": False, "reason": reason, "message": message, "margins": {}, "seconds": 0.0}


def _load(path: str) -> Any:
    from zkdv.sliced import load_program

    return load_program(Path(path).read_bytes())


def verify_slice(arguments: dict[str, Any]) -> dict[str, Any]:
    """Verify one opened slice from the run file, programs, answer and opening in the inputs.

    Returns:
        The verdict, or a failure the lab caused before it could run: ``opening_format``
        (an opening that is not one), ``program_unsafe`` (a program
        :mod:`zkdv.untrusted` refuses), ``program`` (one that does not load).
    """
    import torch
    from torch.func import functional_call

    from provers.sliced import verify_slice as verify
    from zkdv.sliced import (
        RunFile,
        SliceAnswer,
        SliceChallenge,
        SlicedFormatError,
        answer_from_bytes,
        opening_from_bytes,
    )
    from zkdv.untrusted import ProgramUnsafeError

    run_file = RunFile.from_bytes(Path(arguments["run_file"]).read_bytes())
    try:
        opening = opening_from_bytes(Path(arguments["opening"]).read_bytes())
    except SlicedFormatError as error:
        return _failed("opening_format", f"the opening is malformed: {error}")
    try:
        block = _load(arguments["block"])
        embed_program = _load(arguments["embed"]) if arguments.get("embed") else None
    except ProgramUnsafeError as error:
        return _failed(error.reason, f"a committed program is refused: {error}")
    except Exception as error:  # noqa: BLE001 - the lab's bytes: torch.export.load raises anything
        return _failed("program", f"a committed program does not load: {error}")

    embed: Callable[..., torch.Tensor] | None = None
    if embed_program is not None:

        def embed(tables: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
            weights = {name: t.to(torch.float64) for name, t in tables.items()}
            embedded: torch.Tensor = functional_call(embed_program, weights, (tokens,))
            return embedded

    shape = (
        int(arguments["projections"]),
        int(arguments["micro_batches"]),
        int(arguments["rows"]),
    )
    step = int(arguments["step"])
    verdict = verify(
        run_file.steps[step],
        SliceChallenge(
            step,
            int(arguments["block_index"]),
            bytes.fromhex(arguments["directions"]),
            int(arguments["projections"]),
        ),
        SliceAnswer(answer_from_bytes(Path(arguments["answer"]).read_bytes(), shape)),
        [(int(m), int(r)) for m, r in arguments["sequences"]],
        opening,
        names=run_file.names,
        layout=run_file.layout,
        block=block,
        chunk_bytes=run_file.chunk_bytes,
        inputs=run_file.inputs if embed is not None else (),
        embed=embed,
    )
    return {
        "ok": verdict.ok,
        "reason": verdict.reason,
        "message": verdict.message,
        # JSON has no infinity: a measure off every scale is null.
        "margins": {
            k: (float(v) if math.isfinite(v) else None) for k, v in verdict.margins.items()
        },
        "seconds": verdict.seconds,
    }


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(256).decode("utf-8", "replace")
    except OSError:
        return None


def inspect(arguments: dict[str, Any]) -> dict[str, Any]:
    """What this child sees: environment, readable paths, network, writable inputs."""
    connect = arguments.get("connect")
    reached = None
    if connect:
        try:
            with socket.create_connection((str(connect[0]), int(connect[1])), timeout=2):
                reached = "connected"
        except OSError as error:
            reached = f"{type(error).__name__}: {error}"
    try:
        with open("written-by-the-child", "wb"):
            written = True
    except OSError:
        written = False
    import resource

    return {
        "ok": True,
        "environment": dict(os.environ),
        "limits": {
            name: resource.getrlimit(getattr(resource, f"RLIMIT_{name.upper()}"))[0]
            for name in ("as", "cpu", "fsize", "nofile")
        },
        "read": {path: _read(path) for path in arguments.get("paths") or []},
        "connect": reached,
        "wrote_inputs": written,
        "inputs": sorted(os.listdir(".")),
    }


def environment(arguments: dict[str, Any]) -> dict[str, Any]:
    """Where this host replays with a prover (its ``environment()``), opened here."""
    import importlib

    import provers

    name = str(arguments["prover"])
    if name not in provers.PROVERS.values():
        return _failed("unknown_prover", f"{name!r} is not one of the platform's provers")
    return {"ok": True, "environment": importlib.import_module(name).environment()}


#: Job name -> the function the child runs.
JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "replay": replay,
    "slice": verify_slice,
    "inspect": inspect,
    "environment": environment,
}
