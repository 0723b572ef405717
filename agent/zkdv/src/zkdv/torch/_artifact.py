"""Hermetic Torch program artifacts: what a transcript commits, and how it is loaded.

Every Torch program is committed as a ``torch.export`` archive (:func:`serialize`):
the graph's structure, no weights (the parameters are inputs), no pickles, no
provenance, and the same bytes for the same program. Its bytes reach
``torch.export.load`` only through :func:`zkdv.untrusted.safe_export_archive`, which
refuses pickles, code in symbolic expressions and node targets outside ATen, and hands
Torch a rebuilt archive. The program's kind says how it runs:

* ``torch.export`` (the default, ``ZKDV_TORCH_PROGRAM=torch.export``): Torch's own eager
  kernels, bit for bit what eager training computes on the same kernels;
* ``aot-inductor``: compiled by ``torch._inductor.aoti_compile_and_package`` from the
  committed archive, by whoever runs it: the SDK at sealing, the platform on its worker.
  No compiled code crosses from the lab to the platform (issue 59): the platform never
  loads a shared object it did not build from bytes it checked.

:func:`roundtrip` and :func:`export_roundtrip` seal a program and reload it *from the
committed bytes*, so the program that answers sampled checks is the one committed.
Compiles are cached by the archive's digest and the compiler's environment under
``ZKDV_AOTI_CACHE`` when it is set (the platform's workers set it; a proof's sealing
compiles once anyway).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from zkdv import untrusted
from zkdv.torch import _rng

__all__ = [
    "AOT_INDUCTOR",
    "TORCH_EXPORT",
    "export_roundtrip",
    "load",
    "reproducible",
    "roundtrip",
    "serialize",
]

AOT_INDUCTOR = "aot-inductor"
TORCH_EXPORT = "torch.export"


class LoadedProgram:
    """A loaded program artifact: call it with the flat inputs, get the flat outputs.

    A ``torch.export`` program that draws random numbers (dropout) has every random
    operator bound to a private generator (:func:`zkdv.torch._rng.bind_generator`); each
    call then needs the step's ``seed``.
    """

    def __init__(self, kind: str, runner: Any, directory: Any = None, graph: Any = None) -> None:
        self.kind = kind
        self._runner = runner
        # The exported graph the program was built from (counted by count_flops).
        self._graph = runner if graph is None else graph
        # AOT Inductor maps the package's shared library; keep its files alive.
        self._directory = directory
        self.random = kind == TORCH_EXPORT and _rng.bind_generator(runner)
        self._generators: dict[torch.device, torch.Generator] = {}

    def count_flops(self) -> float | None:
        """FLOPs of one call, by Torch's FLOP counter on fake inputs of the program's shapes.

        What the SDK counted at sealing (``zkdv.torch._lowering.count_flops``), counted
        again from the committed program's graph (for an AOT Inductor program, the graph
        it was compiled from), so a replay can check the step records' claim. None for a
        program whose inputs are not all tensors.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils.flop_counter import FlopCounterMode

        values = [n.meta.get("val") for n in self._graph.graph.nodes if n.op == "placeholder"]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fakes = [
                    mode.from_tensor(torch.empty(tuple(v.shape), dtype=v.dtype)) for v in values
                ]
                with FlopCounterMode(display=False) as counter:
                    self._graph(*fakes)
            return float(counter.get_total_flops())
        except Exception:  # noqa: BLE001 - a program the counter cannot run is not counted
            return None

    def __call__(self, *arguments: torch.Tensor, seed: int | None = None) -> list[torch.Tensor]:
        if self.random:
            if seed is None:
                raise ValueError("this program draws random numbers; run it with its step's seed")
            device = next(
                (a.device for a in arguments if isinstance(a, torch.Tensor)),
                torch.device("cpu"),
            )
            generator = self._generators.get(device)
            if generator is None:
                generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(seed)
            setattr(self._runner, _rng.GENERATOR_ATTRIBUTE, generator)
        with torch.no_grad():
            outputs = self._runner(*arguments)
        return list(outputs)


def _export(function: Any, arguments: tuple[Any, ...]) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(function, tuple(arguments), strict=False)


def serialize(exported: torch.export.ExportedProgram) -> bytearray:
    """The committed bytes of an exported program: provenance stripped, reproducible."""
    strip_provenance(exported)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return bytearray(reproducible(buffer.getvalue()))


def roundtrip(function: Any, arguments: tuple[Any, ...]) -> tuple[LoadedProgram, bytearray]:
    """Export and serialize one program, then compile it with AOT Inductor from those
    bytes, as the platform will."""
    material = serialize(_export(function, arguments))
    return load(material, AOT_INDUCTOR), material


def export_roundtrip(function: Any, arguments: tuple[Any, ...]) -> tuple[LoadedProgram, bytearray]:
    """Serialize and reload one ``torch.export`` program (no native compilation)."""
    material = serialize(_export(function, arguments))
    return load(material, TORCH_EXPORT), material


#: Node metadata a replay needs: the example values' shapes and dtypes. The rest is
#: provenance for debugging: object ids that change every run (``from_node``) and the
#: lab's source paths and lines (``stack_trace``, module stacks), which the platform
#: does not need to see.
_KEPT_METADATA = frozenset({"val", "tensor_meta"})


def strip_provenance(exported: torch.export.ExportedProgram) -> None:
    for node in exported.graph.nodes:
        for key in [key for key in node.meta if key not in _KEPT_METADATA]:
            del node.meta[key]


#: The member Torch's archive writer fills with a fresh random id on every save.
_SERIALIZATION_ID = ".data/serialization_id"


def reproducible(archive: bytes) -> bytes:
    """The same archive with its random serialization id replaced by a content hash.

    Torch writes a new random id into every archive it saves, so sealing the same step
    twice gave two program digests. Rewritten (stored, entries in their order, fixed
    dates, the id a SHA-256 of every other member), the same program always has the
    same bytes: a trainer can reproduce the committed digest, and the two commitment
    paths write byte-identical transcripts.
    """
    source = zipfile.ZipFile(io.BytesIO(archive))
    members = [(info, source.read(info)) for info in source.infolist()]
    digest = hashlib.sha256()
    for info, body in members:
        if not info.filename.endswith(_SERIALIZATION_ID):
            digest.update(info.filename.encode() + b"\0" + body)
    identity = str(int.from_bytes(digest.digest()[:16], "big")).zfill(40)[:40].encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for info, body in members:
            entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            entry.compress_type = zipfile.ZIP_STORED
            target.writestr(entry, identity if info.filename.endswith(_SERIALIZATION_ID) else body)
    return out.getvalue()


def load(material: bytes | bytearray, kind: str = TORCH_EXPORT) -> LoadedProgram:
    """Load a program artifact from its exact committed bytes.

    The bytes are a ``torch.export`` archive, loaded only as
    :func:`zkdv.untrusted.safe_export_archive` rebuilds it; an ``aot-inductor`` program
    is then compiled here (:func:`_compiled`). Anything else, a compiled package among
    them, is refused before Torch sees it.

    Args:
        material: the artifact's bytes.
        kind: ``torch.export`` or ``aot-inductor``.

    Raises:
        ValueError: an unknown program kind.
        zkdv.untrusted.ProgramUnsafeError: a program the platform will not load (its
            reason is ``program_unsafe``).
    """
    if kind not in (TORCH_EXPORT, AOT_INDUCTOR):
        raise ValueError(f"unknown ZKDV Torch program kind {kind!r}")
    exported = torch.export.load(io.BytesIO(untrusted.safe_export_archive(material)))
    if kind == TORCH_EXPORT:
        return LoadedProgram(kind, exported.module())
    return _compiled(material, exported)


def _compiled(material: bytes | bytearray, exported: torch.export.ExportedProgram) -> LoadedProgram:
    """The AOT Inductor compile of a checked archive, from ``ZKDV_AOTI_CACHE`` if there.

    A cache entry is named ``<sha256 of the archive>-<compiler environment>.pt2`` (what
    :class:`provers.sandbox.CompileCache` hands a replay child by the archive's digest);
    one that does not load is compiled again and replaced.
    """
    environment = hashlib.sha256(_compiler_environment().encode()).hexdigest()[:16]
    name = f"{hashlib.sha256(bytes(material)).hexdigest()}-{environment}.pt2"
    cache = os.environ.get("ZKDV_AOTI_CACHE", "")
    directory = tempfile.TemporaryDirectory(prefix="zkdv-aoti-")
    path = Path(directory.name, "program.pt2")
    cached = Path(cache, name) if cache else None
    if cached is not None and cached.is_file():
        shutil.copyfile(cached, path)
        try:
            runner = torch._inductor.aoti_load_package(str(path))
            return LoadedProgram(AOT_INDUCTOR, runner, directory, graph=exported.module())
        except Exception:  # noqa: BLE001 - a damaged entry: compiled again below
            path.unlink()
    # The archive's sample inputs were dropped unread (a pickle): zeros of the
    # placeholders' shapes and dtypes are all a compile needs of them.
    exported.example_inputs = (_example_inputs(exported), {})
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(path, partial)
        os.replace(partial, cached)
    runner = torch._inductor.aoti_load_package(str(path))
    return LoadedProgram(AOT_INDUCTOR, runner, directory, graph=exported.module())


def _example_inputs(exported: torch.export.ExportedProgram) -> tuple[torch.Tensor, ...]:
    """Zeros shaped as the program's user inputs (from the graph's recorded values)."""
    names = set(exported.graph_signature.user_inputs)
    values = [
        node.meta["val"]
        for node in exported.graph.nodes
        if node.op == "placeholder" and node.name in names
    ]
    return tuple(
        torch.zeros([int(d) for d in v.shape], dtype=v.dtype, device=v.device) for v in values
    )


def _compiler_environment() -> str:
    """What an AOT Inductor compile's code depends on: Torch's version, the machine and
    the vector instructions Inductor picks, and the CPU kernel family setting."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa())
    except Exception:  # noqa: BLE001 - an older or newer Inductor: the version decides
        isa = "unknown"
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return f"torch {torch.__version__}; {os.uname().machine}; isa {isa}; aten {capability}"
