"""Hermetic Torch AOT artifact compilation and loading.

Torch 2.13 has no ``torch.compile(...).aot_compile`` / ``save_compiled_function`` pair
(the seed's internals); its ahead-of-time path is ``torch.export.export`` followed by
``torch._inductor.aoti_compile_and_package``, which writes one self-contained ``.pt2``
package (generated C++, the compiled shared library and the constants), and
``torch._inductor.aoti_load_package`` to run it. :func:`roundtrip` compiles once,
keeps the package's exact bytes (they are what the transcript commits) and reloads
the program *from those bytes*, so the program that answers sampled checks is the one
committed. The platform never loads such a package: it is a shared object the lab
built, native code (issue 59); :func:`load` refuses it unless the caller made it itself
(``trusted=True``, the SDK's own sealing).

``torch.export`` programs (:func:`export_roundtrip`) are the fast alternative used by
``ZKDV_TORCH_PROGRAM=torch.export``: serialized in seconds, replayed by Torch's own
eager kernels. Their bytes reach ``torch.export.load`` only through
:func:`zkdv.untrusted.safe_export_archive`, which refuses pickles, code in symbolic
expressions and node targets outside ATen, and hands Torch a rebuilt archive.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from zkdv import untrusted
from zkdv.torch import _rng

__all__ = ["AOT_INDUCTOR", "TORCH_EXPORT", "export_roundtrip", "load", "reproducible", "roundtrip"]

AOT_INDUCTOR = "aot-inductor"
TORCH_EXPORT = "torch.export"


class LoadedProgram:
    """A loaded program artifact: call it with the flat inputs, get the flat outputs.

    A ``torch.export`` program that draws random numbers (dropout) has every random
    operator bound to a private generator (:func:`zkdv.torch._rng.bind_generator`); each
    call then needs the step's ``seed``.
    """

    def __init__(self, kind: str, runner: Any, directory: Any = None) -> None:
        self.kind = kind
        self._runner = runner
        # AOT Inductor maps the package's shared library; keep its files alive.
        self._directory = directory
        self.random = kind == TORCH_EXPORT and _rng.bind_generator(runner)
        self._generators: dict[torch.device, torch.Generator] = {}

    def count_flops(self) -> float | None:
        """FLOPs of one call, by Torch's FLOP counter on fake inputs of the program's shapes.

        What the SDK counted at sealing (``zkdv.torch._lowering.count_flops``), counted
        again from the committed program, so a replay can check the step records' claim.
        A ``torch.export`` program only: an AOT Inductor package is native code, with no
        graph to count (None), as is a program whose inputs are not all tensors.
        """
        if self.kind != TORCH_EXPORT:
            return None
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils.flop_counter import FlopCounterMode

        values = [n.meta.get("val") for n in self._runner.graph.nodes if n.op == "placeholder"]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fakes = [
                    mode.from_tensor(torch.empty(tuple(v.shape), dtype=v.dtype)) for v in values
                ]
                with FlopCounterMode(display=False) as counter:
                    self._runner(*fakes)
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


def roundtrip(function: Any, arguments: tuple[Any, ...]) -> tuple[LoadedProgram, bytearray]:
    """Compile, serialize, and reload one exact AOT Inductor program."""
    exported = _export(function, arguments)
    with tempfile.TemporaryDirectory(prefix="zkdv-aoti-") as directory:
        path = torch._inductor.aoti_compile_and_package(
            exported, package_path=os.path.join(directory, "program.pt2")
        )
        material = bytearray(Path(path).read_bytes())
    return load(material, AOT_INDUCTOR, trusted=True), material


def export_roundtrip(function: Any, arguments: tuple[Any, ...]) -> tuple[LoadedProgram, bytearray]:
    """Serialize and reload one ``torch.export`` program (no native compilation)."""
    exported = _export(function, arguments)
    strip_provenance(exported)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    material = bytearray(reproducible(buffer.getvalue()))
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


def load(
    material: bytes | bytearray, kind: str = AOT_INDUCTOR, *, trusted: bool = False
) -> LoadedProgram:
    """Load a program artifact from its exact committed bytes.

    Args:
        material: the artifact's bytes.
        kind: ``torch.export`` or ``aot-inductor``.
        trusted: the caller compiled these bytes itself (the SDK's sealing). Otherwise
            an AOT Inductor package is refused, and a ``torch.export`` archive is
            loaded only as :func:`zkdv.untrusted.safe_export_archive` rebuilds it.

    Raises:
        ValueError: an unknown program kind.
        zkdv.untrusted.ProgramUnsafeError: an untrusted program the platform will not
            load (its reason is ``program_unsafe``).
    """
    if kind == TORCH_EXPORT:
        exported = torch.export.load(io.BytesIO(untrusted.safe_export_archive(material)))
        return LoadedProgram(kind, exported.module())
    if kind != AOT_INDUCTOR:
        raise ValueError(f"unknown ZKDV Torch program kind {kind!r}")
    if not trusted:
        untrusted.refuse_native(kind)
    directory = tempfile.TemporaryDirectory(prefix="zkdv-aoti-load-")
    path = Path(directory.name, "program.pt2")
    path.write_bytes(bytes(material))
    runner = torch._inductor.aoti_load_package(str(path))
    return LoadedProgram(kind, runner, directory)
