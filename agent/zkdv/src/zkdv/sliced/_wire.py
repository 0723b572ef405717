"""What a sliced run sends the platform, as bytes: the run file, the answer, the opening.

The platform's HTTP path (``docs/scale.md``, "The platform's path") moves three things,
each through the upload API or one request body, and reads each back with a precise
error for anything malformed:

* the **run file** (:class:`RunFile`): the block layout, the committed parameter order,
  the chunk size, the input check's parameters, the SHA-256 of each block's program and
  of the embedding's, and every step's commitment. Its SHA-256 is the run's identity:
  the platform's challenges are drawn from it, so it is fixed before any is drawn;
* the **answer**: ``c[q][micro][row]``, little-endian float64 (:func:`answer_to_bytes`);
* the **opening** (:func:`opening_to_bytes`): canonical CBOR of a :class:`SliceOpening`.

Programs are ``torch.export`` archives of one block (and of the embedding), exported in
float64 on the ``meta`` device (:func:`export_program`): the platform calls them with the
opened weights, so the archive carries the structure and no weight of the run.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from zkdv.merkle import LeafSpec
from zkdv.sliced._bounded import Field, SlicedFormatError, read_document
from zkdv.sliced._commitment import (
    _KINDS,
    SLICED_VERSION,
    BlockLayout,
    StepCommitment,
)
from zkdv.sliced._openings import (
    BatchRowOpening,
    DigestPath,
    RowOpening,
    SliceOpening,
    TensorOpening,
)

#: What a run file says it is (its ``kind``).
RUN_FILE_KIND = "zkdv-sliced-run"
#: What an opening says it is.
OPENING_KIND = "zkdv-sliced-opening"
#: Digests in the wire format are 32 bytes.
_DIGEST = 32
#: Row and batch dtypes an opening may carry (boundaries are float32 in this prototype,
#: batch rows token ids).
_ROW_DTYPES = frozenset({"float32", "float64", "bfloat16", "float16"})
_TOKEN_DTYPES = frozenset({"int64", "int32", "uint32", "uint16"})


def _sha256_hex(value: Any, where: str) -> str:
    if (
        not isinstance(value, str)
        or len(value) != 64
        or any(c not in "0123456789abcdef" for c in value)
    ):
        raise SlicedFormatError(where, "expected a SHA-256 as 64 lowercase hex digits")
    return value


def _digest(value: Any, where: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != _DIGEST:
        raise SlicedFormatError(where, f"expected a {_DIGEST}-byte digest")
    return value


def _count(value: Any, where: str, *, low: int = 0, high: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SlicedFormatError(where, f"expected an integer from {low} to {high}")
    return value


def _text(value: Any, where: str, *, limit: int = 1024) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise SlicedFormatError(where, f"expected a non-empty string of at most {limit} characters")
    return value


def _list(value: Any, where: str, *, limit: int = 1 << 20) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise SlicedFormatError(where, f"expected a list of at most {limit} items")
    return value


def _map(value: Any, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SlicedFormatError(where, f"expected a map with the keys {', '.join(keys)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise SlicedFormatError(f"{where}.{missing[0]}", "missing")
    return value


@dataclass(frozen=True)
class RunFile:
    """One sliced run, committed before any challenge: the platform files it by its bytes.

    ``programs[b]`` is the SHA-256 (hex) of block ``b``'s program and ``embed`` the
    embedding's (empty without the input check); they are uploaded beside the run file,
    and its digest binds them.
    """

    layout: BlockLayout
    names: tuple[str, ...]
    chunk_bytes: int
    inputs: tuple[str, ...]
    programs: tuple[str, ...]
    embed: str
    steps: tuple[StepCommitment, ...]

    def to_bytes(self) -> bytes:
        return cbor2.dumps(
            {
                "v": SLICED_VERSION,
                "kind": RUN_FILE_KIND,
                "blocks": [[name, list(names)] for name, names in self.layout.blocks],
                "names": list(self.names),
                "chunk_bytes": self.chunk_bytes,
                "inputs": list(self.inputs),
                "programs": list(self.programs),
                "embed": self.embed,
                "steps": [step.to_dict() for step in self.steps],
            },
            canonical=True,
        )

    def digest(self) -> str:
        """SHA-256 (hex) of :meth:`to_bytes`: the uploaded file's digest, the run's id."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(micro_batches, boundaries, rows)`` of every step (one shape per run)."""
        return self.steps[0].shape

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RunFile:
        """Read a run file; :class:`SlicedFormatError` names the first malformed field."""
        body = _map(read_document(data, "run file", _RUN_FILE_FIELDS), "run file", _RUN_FILE_KEYS)
        if body["v"] != SLICED_VERSION or body["kind"] != RUN_FILE_KIND:
            raise SlicedFormatError(
                "v", f"expected version {SLICED_VERSION!r} of a {RUN_FILE_KIND!r}"
            )
        # Every list below was read and its elements checked one by one as the document
        # was (_RUN_FILE_FIELDS); what is left is how they agree with each other.
        names = tuple(body["names"])
        # Membership is tested against a set: a tuple made it quadratic (25,000 names
        # took 6 s inside the request).
        committed = frozenset(names)
        if len(committed) != len(names):
            raise SlicedFormatError("names", "a parameter is named twice")
        blocks = body["blocks"]
        for b, (prefix, members) in enumerate(blocks):
            for i, member in enumerate(members):
                if member not in committed or not member.startswith(prefix + "."):
                    raise SlicedFormatError(
                        f"blocks[{b}][1][{i}]",
                        f"{member!r} is not a committed parameter under {prefix!r}",
                    )
            if not members:
                raise SlicedFormatError(f"blocks[{b}][1]", "a block needs parameters")
        if not blocks:
            raise SlicedFormatError("blocks", "a sliced run needs at least one block")
        owned = [n for _, members in blocks for n in members]
        if len(set(owned)) != len(owned):
            raise SlicedFormatError("blocks", "a parameter belongs to two blocks")
        inputs = tuple(body["inputs"])
        for i, name in enumerate(inputs):
            if name not in committed:
                raise SlicedFormatError(f"inputs[{i}]", f"{name!r} is not a committed parameter")
        programs = tuple(body["programs"])
        if len(programs) != len(blocks):
            raise SlicedFormatError(
                "programs", f"expected one program per block ({len(blocks)}), got {len(programs)}"
            )
        embed = body["embed"]
        if inputs:
            embed = _sha256_hex(embed, "embed")
        elif embed != "":
            raise SlicedFormatError("embed", "an embedding program needs inputs")
        steps = tuple(body["steps"])
        if not steps:
            raise SlicedFormatError("steps", "a sliced run needs at least one step")
        for i, step in enumerate(steps):
            if step.shape != steps[0].shape:
                raise SlicedFormatError(f"steps[{i}].shape", "every step has one shape")
            if step.shape[1] != len(blocks) + 1:
                raise SlicedFormatError(
                    f"steps[{i}].shape[1]",
                    f"expected {len(blocks) + 1} boundaries (one more than the blocks)",
                )
        return cls(
            BlockLayout(tuple(blocks)),
            names,
            _count(body["chunk_bytes"], "chunk_bytes", low=64, high=1 << 30),
            inputs,
            programs,
            embed,
            steps,
        )


_HYPERPARAMETERS = ("lr", "eps", "weight_decay", "beta1", "beta2")


def _step(entry: Any, where: str, index: int) -> StepCommitment:
    body = _map(entry, where, ("i", "pre", "post", "grad", "boundary", "batch", "shape", "hp"))
    if _count(body["i"], f"{where}.i") != index:
        raise SlicedFormatError(f"{where}.i", f"expected step {index}: steps are in order")
    pairs = []
    for key in ("pre", "post"):
        pair = _list(body[key], f"{where}.{key}", limit=2)
        if len(pair) != 2:
            raise SlicedFormatError(f"{where}.{key}", "expected [parameters root, optimizer root]")
        pairs.append((_digest(pair[0], f"{where}.{key}[0]"), _digest(pair[1], f"{where}.{key}[1]")))
    shape = _list(body["shape"], f"{where}.shape", limit=3)
    if len(shape) != 3:
        raise SlicedFormatError(f"{where}.shape", "expected [micro_batches, boundaries, rows]")
    dims = tuple(_count(d, f"{where}.shape[{k}]", low=1, high=1 << 20) for k, d in enumerate(shape))
    hp = _map(body["hp"], f"{where}.hp", _HYPERPARAMETERS)
    values = {}
    for key in _HYPERPARAMETERS:
        value = hp[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise SlicedFormatError(f"{where}.hp.{key}", "expected a finite number")
        values[key] = float(value)
    return StepCommitment(
        index,
        pairs[0],
        pairs[1],
        _digest(body["grad"], f"{where}.grad"),
        _digest(body["boundary"], f"{where}.boundary"),
        _digest(body["batch"], f"{where}.batch"),
        (dims[0], dims[1], dims[2]),
        values,
    )


def _name(value: Any, where: str, index: int) -> str:
    return _text(value, where)


def _block(entry: Any, where: str, index: int) -> tuple[str, tuple[str, ...]]:
    """``[prefix, [names]]``; whether the names are committed is checked once all are read."""
    if not isinstance(entry, list) or len(entry) != 2:
        raise SlicedFormatError(where, "expected [prefix, [parameter names]]")
    prefix = _text(entry[0], f"{where}[0]")
    members = tuple(
        _text(n, f"{where}[1][{i}]") for i, n in enumerate(_list(entry[1], f"{where}[1]"))
    )
    return prefix, members


#: The most parameters a run file may name, blocks it may have, and steps it may commit.
MAX_NAMES = 1 << 20
MAX_BLOCKS = 1 << 16
MAX_STEPS = 1 << 24
#: Strings in a run file: a name is at most 1024 characters (4 bytes each in UTF-8).
_NAME_BYTES = 4096
_RUN_FILE_KEYS = (
    "v", "kind", "blocks", "names", "chunk_bytes", "inputs", "programs", "embed", "steps"
)  # fmt: skip
_SCALAR = Field(items=1, depth=0, string=64)
#: How each field of a run file is read (zkdv.sliced._bounded): counts and sizes are
#: checked from the CBOR headers before anything is decoded, and each list element is
#: decoded on its own. A step is a map of 34 data items (8 keys, two root pairs, three
#: digests, a shape of 3, five hyperparameters); a block is a prefix and its names.
_RUN_FILE_FIELDS = {
    "v": _SCALAR,
    "kind": _SCALAR,
    "chunk_bytes": _SCALAR,
    "embed": _SCALAR,
    "names": Field(items=1, depth=0, string=_NAME_BYTES, limit=MAX_NAMES, read=_name),
    "inputs": Field(items=1, depth=0, string=_NAME_BYTES, limit=MAX_NAMES, read=_name),
    "programs": Field(
        items=1, depth=0, string=64, limit=MAX_BLOCKS, read=lambda v, w, i: _sha256_hex(v, w)
    ),
    "blocks": Field(
        items=MAX_NAMES + 3, depth=2, string=_NAME_BYTES, limit=MAX_BLOCKS, read=_block
    ),
    "steps": Field(items=40, depth=2, string=_DIGEST, limit=MAX_STEPS, read=_step),
}


# --- The answer -------------------------------------------------------------------------------


def answer_to_bytes(projections: np.ndarray) -> bytes:
    """``c`` as the platform takes it: little-endian float64, ``(q, micro_batches, rows)``."""
    return np.ascontiguousarray(projections, dtype="<f8").tobytes()


def answer_from_bytes(data: bytes, shape: tuple[int, int, int]) -> np.ndarray:
    """The projections of an answer body, which must hold exactly ``shape`` float64 values."""
    expected = int(np.prod(shape)) * 8
    if len(data) != expected:
        raise SlicedFormatError(
            "body",
            f"expected {expected} bytes ({shape[0]} projections x {shape[1]} micro-batches x "
            f"{shape[2]} rows, float64 little-endian), got {len(data)}",
        )
    values = np.frombuffer(data, dtype="<f8").reshape(shape).astype(np.float64)
    if not np.isfinite(values).all():
        raise SlicedFormatError("body", "a projection is not finite (NaN or infinity)")
    return values


# --- The opening ------------------------------------------------------------------------------


def _tensor(t: TensorOpening) -> dict[str, Any]:
    return {
        "index": t.index,
        "count": t.count,
        "spec": t.spec.to_dict(),
        "data": t.data,
        "path": list(t.path),
        "root": t.tensors_root,
    }


def _digest_path(p: DigestPath) -> dict[str, Any]:
    return {"index": p.index, "count": p.count, "path": list(p.path), "root": p.tensors_root}


def _array(a: np.ndarray) -> dict[str, Any]:
    return {
        "dtype": str(a.dtype),
        "shape": list(a.shape),
        "data": np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes(),
    }


def opening_to_bytes(opening: SliceOpening) -> bytes:
    """Canonical CBOR of everything one sliced challenge opens."""
    return cbor2.dumps(
        {
            "v": SLICED_VERSION,
            "kind": OPENING_KIND,
            "params": [_tensor(t) for t in opening.params],
            "opt_state": [_tensor(t) for t in opening.opt_state],
            "grad": [_tensor(t) for t in opening.grad],
            "post_params": [_digest_path(p) for p in opening.post_params],
            "post_opt_state": [_digest_path(p) for p in opening.post_opt_state],
            "rows": [
                {
                    "micro": r.micro,
                    "boundary": r.boundary,
                    "kind": r.kind,
                    "row": r.row,
                    **_array(r.data),
                    "path": list(r.path),
                }
                for r in opening.rows
            ],
            "inputs": [_tensor(t) for t in opening.inputs],
            "batch_rows": [
                {"micro": r.micro, "row": r.row, **_array(r.data), "path": list(r.path)}
                for r in opening.batch_rows
            ],
        },
        canonical=True,
    )


def _path(value: Any, where: str) -> tuple[bytes, ...]:
    return tuple(_digest(d, f"{where}[{i}]") for i, d in enumerate(_list(value, where, limit=64)))


def _spec(value: Any, where: str) -> LeafSpec:
    body = _map(value, where, ("path", "dtype", "shape"))
    dtype = _text(body["dtype"], f"{where}.dtype", limit=16)
    try:
        np.dtype(dtype)
    except TypeError:
        raise SlicedFormatError(f"{where}.dtype", f"{dtype!r} is not a dtype") from None
    shape = tuple(
        _count(d, f"{where}.shape[{k}]", high=1 << 40)
        for k, d in enumerate(_list(body["shape"], f"{where}.shape", limit=8))
    )
    return LeafSpec(_text(body["path"], f"{where}.path"), dtype, shape)


def _read_tensor(value: Any, where: str) -> TensorOpening:
    body = _map(value, where, ("index", "count", "spec", "data", "path", "root"))
    spec = _spec(body["spec"], f"{where}.spec")
    data = body["data"]
    if not isinstance(data, bytes) or len(data) != spec.nbytes:
        raise SlicedFormatError(f"{where}.data", f"expected {spec.nbytes} bytes for {spec.path}")
    return TensorOpening(
        _count(body["index"], f"{where}.index"),
        _count(body["count"], f"{where}.count", low=1),
        spec,
        data,
        _path(body["path"], f"{where}.path"),
        _digest(body["root"], f"{where}.root"),
    )


def _read_digest_path(value: Any, where: str) -> DigestPath:
    body = _map(value, where, ("index", "count", "path", "root"))
    return DigestPath(
        _count(body["index"], f"{where}.index"),
        _count(body["count"], f"{where}.count", low=1),
        _path(body["path"], f"{where}.path"),
        _digest(body["root"], f"{where}.root"),
    )


def _read_array(body: Mapping[str, Any], where: str, dtypes: frozenset[str]) -> np.ndarray:
    dtype = body["dtype"]
    if dtype not in dtypes:
        raise SlicedFormatError(f"{where}.dtype", f"expected one of {', '.join(sorted(dtypes))}")
    shape = tuple(
        _count(d, f"{where}.shape[{k}]", high=1 << 32)
        for k, d in enumerate(_list(body["shape"], f"{where}.shape", limit=4))
    )
    data = body["data"]
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) != size:
        raise SlicedFormatError(f"{where}.data", f"expected {size} bytes for shape {list(shape)}")
    little = np.dtype(dtype).newbyteorder("<")
    return np.frombuffer(data, dtype=little).reshape(shape).astype(dtype)


def _read_row(entry: Any, where: str, index: int) -> RowOpening:
    row = _map(entry, where, ("micro", "boundary", "kind", "row", "dtype", "shape", "data", "path"))
    if row["kind"] not in _KINDS:
        raise SlicedFormatError(f"{where}.kind", f"expected one of {', '.join(_KINDS)}")
    return RowOpening(
        _count(row["micro"], f"{where}.micro"),
        _count(row["boundary"], f"{where}.boundary"),
        row["kind"],
        _count(row["row"], f"{where}.row"),
        _read_array(row, where, _ROW_DTYPES),
        _path(row["path"], f"{where}.path"),
    )


def _read_batch_row(entry: Any, where: str, index: int) -> BatchRowOpening:
    row = _map(entry, where, ("micro", "row", "dtype", "shape", "data", "path"))
    return BatchRowOpening(
        _count(row["micro"], f"{where}.micro"),
        _count(row["row"], f"{where}.row"),
        _read_array(row, where, _TOKEN_DTYPES),
        _path(row["path"], f"{where}.path"),
    )


#: The most tensors (or digest paths) one opening lists per kind, and rows.
MAX_OPENED_TENSORS = 4096
MAX_OPENED_ROWS = 1 << 16
#: Tensor and row data is bounded by the upload that holds the opening, not here.
_DATA_BYTES = 1 << 62
_OPENING_KEYS = (
    "v", "kind", "params", "opt_state", "grad", "post_params", "post_opt_state", "rows",
    "inputs", "batch_rows",
)  # fmt: skip


def _opened(read: Any, *, depth: int = 3, limit: int = MAX_OPENED_TENSORS) -> Field:
    # A tensor opening is at most 92 data items (its spec's shape has at most 8
    # dimensions, its path at most 64 digests), a row at most 86; each element is
    # decoded and converted on its own (zkdv.sliced._bounded).
    return Field(items=128, depth=depth, string=_DATA_BYTES, limit=limit, read=read)


_OPENING_FIELDS = {
    "v": _SCALAR,
    "kind": _SCALAR,
    **{
        key: _opened(lambda value, where, index: _read_tensor(value, where))
        for key in ("params", "opt_state", "grad", "inputs")
    },
    **{
        key: _opened(lambda value, where, index: _read_digest_path(value, where), depth=2)
        for key in ("post_params", "post_opt_state")
    },
    "rows": _opened(_read_row, depth=2, limit=MAX_OPENED_ROWS),
    "batch_rows": _opened(_read_batch_row, depth=2, limit=MAX_OPENED_ROWS),
}


def opening_from_bytes(data: bytes | bytearray | memoryview) -> SliceOpening:
    """Read an opening; :class:`SlicedFormatError` names the first malformed field.

    Each listed tensor, path and row is decoded and checked on its own, within the
    limits of ``_OPENING_FIELDS``, so a malformed one is refused before the next is read.
    """
    body = _map(read_document(data, "opening", _OPENING_FIELDS), "opening", _OPENING_KEYS)
    if body["v"] != SLICED_VERSION or body["kind"] != OPENING_KIND:
        raise SlicedFormatError("v", f"expected version {SLICED_VERSION!r} of a {OPENING_KIND!r}")
    return SliceOpening(
        params=tuple(body["params"]),
        opt_state=tuple(body["opt_state"]),
        grad=tuple(body["grad"]),
        post_params=tuple(body["post_params"]),
        post_opt_state=tuple(body["post_opt_state"]),
        rows=tuple(body["rows"]),
        inputs=tuple(body["inputs"]),
        batch_rows=tuple(body["batch_rows"]),
    )


# --- Programs ---------------------------------------------------------------------------------


def export_program(module: Any, example: Sequence[Any]) -> bytes:
    """A ``torch.export`` archive of ``module`` (a block, or the embedding), for the platform.

    Exported in float64 on the ``meta`` device: the platform calls it with the opened
    weights (``torch.func.functional_call``), so the archive holds the structure and no
    weight at all. Its size does not grow with the block's, and the same structure always
    has the same bytes (:func:`zkdv.torch.programs.reproducible`), whichever run it came
    from. ``example`` are example inputs (float tensors are exported as float64).

    Raises:
        ValueError: a module with buffers (their values would have to be committed too),
            or one that creates a tensor on a fixed device, which would be ``meta``.
    """
    import copy
    import io

    import torch

    from zkdv.torch.programs import reproducible, strip_provenance

    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        raise ValueError(
            f"a sliced block's state is its parameters; {buffers[0]!r} is a buffer, whose "
            "values the run does not commit"
        )
    structure = copy.deepcopy(module).to(dtype=torch.float64).to("meta").eval()
    arguments = tuple(
        (a.to(torch.float64) if a.is_floating_point() else a).to("meta")
        if isinstance(a, torch.Tensor)
        else a
        for a in example
    )
    exported = torch.export.export(structure, arguments, strict=False)
    for node in exported.graph.nodes:
        if node.kwargs.get("device") == torch.device("meta"):
            raise ValueError(
                f"the program makes a new tensor on a fixed device ({node.target}), which "
                "exporting on the meta device fixes as meta: slice a parameter or an input "
                "instead (weight[:n], not embedding(torch.arange(n)))"
            )
    strip_provenance(exported)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return reproducible(buffer.getvalue())


def load_program(data: bytes) -> Any:
    """The module of a program archive (:func:`export_program`'s bytes).

    The bytes are a lab's: Torch loads only the archive
    :func:`zkdv.untrusted.safe_export_archive` rebuilds from them.

    Raises:
        zkdv.untrusted.ProgramUnsafeError: a program the platform will not load
            (a pickle, code in a symbolic expression, a node target outside ATen).
    """
    import io

    import torch

    from zkdv.untrusted import safe_export_archive

    return torch.export.load(io.BytesIO(safe_export_archive(data))).module()
