"""Malicious programs for the tests of issue 59, built from real exported programs.

Each payload edits the members of a real ``torch.export`` archive (the project's own
export, as the SDK or ``zkdv.sliced.export_program`` wrote it) the way the security
round did, so that plain ``torch.export.load`` runs the payload: it creates ``marker``.

* :func:`pickled_weight`: a weight entry marked ``use_pickle`` whose file is a pickle
  that calls ``os.system`` when unpickled;
* :func:`evaluated_expression`: a tensor size whose ``expr_str`` is
  ``__import__('os').system(...) or Symbol('s77', positive=True, integer=True)``,
  which ``sympy.sympify`` evaluates;
* :func:`foreign_target`: a node whose target is a Python function under ``torch``
  (``torch.save``), which the deserialized program would call;
* :func:`jax_custom_call_program`: a ``jax.export`` program that names a custom-call
  target outside the allow-list (an FFI handler of the lab's naming).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import zipfile
from pathlib import Path
from typing import Any

from zkdv.core import file_digest

WEIGHTS_CONFIG = "archive/data/weights/model_weights_config.json"
MODEL = "archive/models/model.json"


class _System:
    """Unpickles as ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _edit(archive: bytes, edits: dict[str, bytes]) -> bytes:
    """The archive with members replaced or added (stored, as Torch writes them)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            body = edits.pop(info.filename, None)
            target.writestr(info.filename, source.read(info) if body is None else body)
        for name, body in edits.items():
            target.writestr(name, body)
    return out.getvalue()


def pickled_weight(archive: bytes, marker: Path) -> bytes:
    """A weight marked ``use_pickle`` whose payload runs ``touch marker`` when unpickled."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    config = json.loads(source.read(WEIGHTS_CONFIG))
    config["config"]["planted"] = {
        "path_name": "weight_planted",
        "is_param": False,
        "use_pickle": True,
        "tensor_meta": None,
    }
    payload = pickle.dumps(_System(touch(marker)))
    return _edit(
        archive,
        {
            WEIGHTS_CONFIG: json.dumps(config).encode(),
            "archive/data/weights/weight_planted": payload,
        },
    )


def _first_size(model: dict[str, Any]) -> dict[str, Any]:
    values = model["graph_module"]["graph"]["tensor_values"]
    for value in values.values():
        if value["sizes"]:
            return value  # type: ignore[no-any-return]
    raise AssertionError("the program has no sized tensor")


def evaluated_expression(archive: bytes, marker: Path) -> bytes:
    """A tensor size whose ``expr_str`` runs ``touch marker`` inside ``sympify``."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    model = json.loads(source.read(MODEL))
    value = _first_size(model)
    hint = value["sizes"][0].get("as_int", 2)
    value["sizes"][0] = {
        "as_expr": {
            "expr_str": f"__import__('os').system({touch(marker)!r}) or "
            "Symbol('s77', positive=True, integer=True)",
            "hint": {"as_int": hint},
        }
    }
    return _edit(archive, {MODEL: json.dumps(model).encode()})


def foreign_target(archive: bytes) -> bytes:
    """The first node's target replaced by ``torch.save``, a Python function."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    model = json.loads(source.read(MODEL))
    model["graph_module"]["graph"]["nodes"][0]["target"] = "torch.save"
    return _edit(archive, {MODEL: json.dumps(model).encode()})


def jax_custom_call_program(target: str = "lab_payload") -> bytearray:
    """A serialized ``jax.export`` program that calls custom-call ``target`` (an FFI
    handler of the lab's naming).

    ``jax.export`` refuses a target without a compatibility guarantee unless its safety
    check is disabled, which is what a lab that means harm does.
    """
    import jax
    import jax.numpy as jnp
    from jax import export

    def program(x: Any) -> Any:
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x) + 1

    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    exported = export.export(
        jax.jit(program), disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
    )(spec)
    return exported.serialize()


def aot_inductor_package() -> bytes:
    """A real AOT Inductor package (a compiled shared object), what a lab that compiled
    its own program would upload (a cold compile is ~10-40 s)."""
    import tempfile

    import torch

    class Program(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [torch.tanh(x) * 2]

    exported = torch.export.export(Program(), (torch.zeros(4, 6),))
    with tempfile.TemporaryDirectory() as folder:
        path = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(Path(folder, "program.pt2"))
        )
        return Path(path).read_bytes()


def forge_program(run: Path, program: bytes, *, kind: str | None = None) -> None:
    """Replace a proof's program file (of ``kind``, by default the run's) and commit it:
    the root's program kind and digest, re-chained.

    What a lab that means harm files: a transcript whose root commits the malicious
    program (the chain is the lab's own to write).
    """
    from zkdv.files import program_file
    from zkdv.hashing import ZERO_DIGEST
    from zkdv.records import encode, iter_records, record_hash

    records = [dict(r.data) for r in iter_records(run)]
    root = records[0]
    kind = kind or str(root["program"]["kind"])
    (run / program_file(kind)).write_bytes(program)
    root["program"] = {**root["program"], "kind": kind, "digest": file_digest(program)}
    out, prev = bytearray(), ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    (run / "records.cborl").write_bytes(bytes(out))
