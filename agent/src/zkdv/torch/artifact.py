"""Hermetic Torch AOT artifact compilation and loading.

Torch 2.13 has no ``torch.compile(...).aot_compile`` / ``save_compiled_function`` pair
(the seed's internals); its ahead-of-time path is ``torch.export.export`` followed by
``torch._inductor.aoti_compile_and_package``, which writes one self-contained ``.pt2``
package (generated C++, the compiled shared library and the constants), and
``torch._inductor.aoti_load_package`` to run it. :func:`roundtrip` compiles once,
keeps the package's exact bytes (they are what the transcript commits) and reloads
the program *from those bytes*, so the program that answers sampled checks is the one
committed. Loading the same bytes on the platform reproduces it bit for bit on the
same hardware and thread count.

``torch.export`` programs (:func:`export_roundtrip`) are the fast alternative used by
``ZKDV_TORCH_PROGRAM=torch.export``: serialized in seconds, replayed by Torch's own
eager kernels.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from zkdv.torch import rng

__all__ = ["AOT_INDUCTOR", "TORCH_EXPORT", "export_roundtrip", "load", "roundtrip"]

AOT_INDUCTOR = "aot-inductor"
TORCH_EXPORT = "torch.export"


class LoadedProgram:
    """A loaded program artifact: call it with the flat inputs, get the flat outputs.

    A ``torch.export`` program that draws random numbers (dropout) has every random
    operator bound to a private generator (:func:`zkdv.torch.rng.bind_generator`); each
    call then needs the step's ``seed``.
    """

    def __init__(self, kind: str, runner: Any, directory: Any = None) -> None:
        self.kind = kind
        self._runner = runner
        # AOT Inductor maps the package's shared library; keep its files alive.
        self._directory = directory
        self.random = kind == TORCH_EXPORT and rng.bind_generator(runner)
        self._generators: dict[torch.device, torch.Generator] = {}

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
            setattr(self._runner, rng.GENERATOR_ATTRIBUTE, generator)
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
    return load(material, AOT_INDUCTOR), material


def export_roundtrip(function: Any, arguments: tuple[Any, ...]) -> tuple[LoadedProgram, bytearray]:
    """Serialize and reload one ``torch.export`` program (no native compilation)."""
    exported = _export(function, arguments)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    material = bytearray(buffer.getvalue())
    return load(material, TORCH_EXPORT), material


def load(material: bytes | bytearray, kind: str = AOT_INDUCTOR) -> LoadedProgram:
    """Load a program artifact from its exact committed bytes.

    Raises:
        ValueError: an unknown program kind.
    """
    if kind == TORCH_EXPORT:
        exported = torch.export.load(io.BytesIO(bytes(material)))
        return LoadedProgram(kind, exported.module())
    if kind != AOT_INDUCTOR:
        raise ValueError(f"unknown ZKDV Torch program kind {kind!r}")
    directory = tempfile.TemporaryDirectory(prefix="zkdv-aoti-load-")
    path = Path(directory.name, "program.pt2")
    path.write_bytes(bytes(material))
    runner = torch._inductor.aoti_load_package(str(path))
    return LoadedProgram(kind, runner, directory)
