"""The trained model's weights as the certificate binds them: safetensors and OpenSSF signing.

``proof.save_model(params)`` (:meth:`dvbench.DVBenchProof.save_model`) writes the final
parameters as one safetensors file whose tensors are named and ordered exactly as the
transcript's parameter schema, checks locally that they commit to the close record's
final parameter root, and signs the file in the OpenSSF Model Signing format with the
``model_signing`` package (``model.sig``, a Sigstore bundle over an in-toto statement
whose subject is the model's manifest digest). Everything lands in the proof
directory's ``model/`` folder, so ``finish()`` uploads it with the proof; the platform
recomputes the root from the uploaded weights and certifies the file's SHA-256 and the
manifest digest. An auditor then runs::

    model_signing verify key model.safetensors --signature model.sig \\
        --public_key model-signing.pub
    dvbench verify-report proof.bundle.json --trust-root trust-root.json --model model/

The signing key is an ECDSA P-256 key (what ``model_signing``'s key-based signer
takes): ``DVBENCH_MODEL_SIGNING_KEY`` names a PEM file of the lab's own, otherwise a
fresh key signs once and its private half is discarded, since the certificate, not the
key, ties the weights to the run.

The safetensors reader here is strict and streams one tensor at a time: the platform
runs it on untrusted uploads.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

__all__ = [
    "MODEL_DIR",
    "MODEL_FILE",
    "PUBLIC_KEY_FILE",
    "SIGNATURE_FILE",
    "ModelMismatchError",
    "SafetensorsError",
    "SavedModel",
    "check_final_parameters",
    "read_safetensors",
    "sign_model",
    "write_safetensors",
]

#: Where a proof directory keeps the final model (uploaded as artifacts under this name).
MODEL_DIR: Final = "model"
MODEL_FILE: Final = "model.safetensors"
SIGNATURE_FILE: Final = "model.sig"
PUBLIC_KEY_FILE: Final = "model-signing.pub"
ENV_MODEL_SIGNING_KEY: Final = "DVBENCH_MODEL_SIGNING_KEY"
#: safetensors refuses headers above 100 MB; so do we (before reading one).
MAX_HEADER_BYTES: Final = 100_000_000

#: numpy dtype name (as zkdv's schema spells it) -> safetensors dtype.
DTYPES: Final = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_NAMES: Final = {code: name for name, code in DTYPES.items()}
_SIZES: Final = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


class SafetensorsError(ValueError):
    """A file is not a well-formed safetensors file; the message says where."""


class ModelMismatchError(ValueError):
    """Weights that are not the final parameters the transcript commits."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    name: str
    dtype: str  # the numpy/zkdv name, e.g. "float32"
    shape: tuple[int, ...]
    start: int
    end: int


def _raw(array: np.ndarray) -> bytes:
    contiguous = np.ascontiguousarray(array)
    if contiguous.dtype.byteorder == ">":
        contiguous = contiguous.byteswap().view(contiguous.dtype.newbyteorder("<"))
    return contiguous.tobytes()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (in this order) as a safetensors file, atomically.

    Raises:
        ValueError: a dtype safetensors cannot hold, or a name given twice.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, array in tensors:
        code = DTYPES.get(str(array.dtype.name))
        if code is None:
            raise ValueError(f"tensor {name!r}: safetensors has no dtype for {array.dtype}")
        if name in header:
            raise ValueError(f"tensor {name!r} is given twice")
        size = int(array.size) * _SIZES[code]
        header[name] = {
            "dtype": code,
            "shape": [int(d) for d in array.shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # as safetensors does: data starts aligned
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for _, array in tensors:
            handle.write(_raw(array))
    os.replace(temporary, target)


def read_header(handle: IO[bytes], size: int) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Read and check a safetensors header from ``handle`` (positioned at 0).

    Returns:
        The tensors in data order, the metadata, and the offset where the data begins.

    Raises:
        SafetensorsError: the header is malformed or does not tile the data exactly.
    """
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise SafetensorsError("the file is shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise SafetensorsError(
            f"the header claims {length} bytes; the file has {size} and the limit is "
            f"{MAX_HEADER_BYTES}"
        )
    raw = handle.read(length)
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SafetensorsError(f"the header is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise SafetensorsError("the header is not a JSON object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")
    entries: list[TensorEntry] = []
    for name, info in document.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"tensor {name!r}: expected dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in _SIZES:
            raise SafetensorsError(f"tensor {name!r}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise SafetensorsError(f"tensor {name!r}: shape must be a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise SafetensorsError(f"tensor {name!r}: data_offsets must be [begin, end]")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if offsets[1] - offsets[0] != count * _SIZES[code]:
            raise SafetensorsError(
                f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {code}"
            )
        entries.append(TensorEntry(name, _NAMES[code], tuple(shape), offsets[0], offsets[1]))
    entries.sort(key=lambda entry: (entry.start, entry.end))
    data = size - 8 - length
    position = 0
    for entry in entries:
        if entry.start != position:
            raise SafetensorsError(
                f"tensor {entry.name!r} starts at {entry.start}; the data before it ends at "
                f"{position} (gaps and overlaps are refused)"
            )
        position = entry.end
    if position != data:
        raise SafetensorsError(f"the tensors cover {position} bytes of data; the file holds {data}")
    return entries, metadata, 8 + length


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the header repeats {key!r}")
        result[key] = value
    return result


def read_safetensors(handle: IO[bytes], size: int) -> Iterator[tuple[TensorEntry, np.ndarray]]:
    """Stream the tensors of a safetensors file, one array at a time, in data order.

    Raises:
        SafetensorsError: the file is malformed.
    """
    entries, _, base = read_header(handle, size)
    for entry in entries:
        handle.seek(base + entry.start)
        data = handle.read(entry.end - entry.start)
        if len(data) != entry.end - entry.start:
            raise SafetensorsError(f"tensor {entry.name!r} is cut short")
        dtype = np.dtype(entry.dtype).newbyteorder("<")
        yield entry, np.frombuffer(data, dtype=dtype).reshape(entry.shape)


def check_final_parameters(
    handle: IO[bytes],
    size: int,
    *,
    specs: Sequence[Mapping[str, Any]],
    chunk_bytes: int,
    final_root: str,
) -> None:
    """Check that a safetensors file holds exactly the transcript's final parameters.

    The tensors must be the parameter schema's leaves (same names, dtypes and shapes),
    and their ZKDV state commitment, in the schema's order, must be ``final_root``.

    Raises:
        SafetensorsError: the file is malformed.
        ModelMismatchError: another set of tensors, or other values.
    """
    from zkdv.merkle import LeafSpec, commit_state

    expected = [LeafSpec.from_dict(dict(spec)) for spec in specs]
    found: dict[str, np.ndarray] = {}
    for entry, array in read_safetensors(handle, size):
        found[entry.name] = array
    names = [spec.path for spec in expected]
    missing = [name for name in names if name not in found]
    extra = sorted(set(found) - set(names))
    if missing or extra:
        raise ModelMismatchError(
            "the model's tensors are not the transcript's parameters: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing[:5])}" if missing else "",
                    f"not in the schema {', '.join(extra[:5])}" if extra else "",
                )
                if part
            )
        )
    leaves = []
    for spec in expected:
        array = found[spec.path]
        if str(array.dtype.name) != spec.dtype or tuple(array.shape) != spec.shape:
            raise ModelMismatchError(
                f"tensor {spec.path!r} is {array.dtype.name}{list(array.shape)}; the schema "
                f"commits {spec.dtype}{list(spec.shape)}"
            )
        leaves.append((spec.path, array))
    root = commit_state(leaves, chunk_bytes).root.hex()
    if root != final_root:
        raise ModelMismatchError(
            f"the weights commit to parameter root {root}, not to the final parameter root "
            f"{final_root} of the transcript's close record"
        )


@dataclass(frozen=True)
class SavedModel:
    """What :meth:`~dvbench.DVBenchProof.save_model` wrote.

    Attributes:
        path: the safetensors file in the proof directory's ``model/`` folder.
        signature: its OpenSSF model signature (``model.sig``).
        public_key: the key that verifies the signature (``model-signing.pub``).
        sha256: the file's SHA-256, which the certificate binds.
        manifest_sha256: the model_signing manifest digest, which the certificate binds.
        copies: where the three files were copied to as well (the ``directory`` argument).
    """

    path: Path
    signature: Path
    public_key: Path
    sha256: str
    manifest_sha256: str
    copies: tuple[Path, ...] = ()


def sign_model(path: Path, *, key_file: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """Sign a model file with ``model_signing`` (key-based, ECDSA P-256), beside it.

    Args:
        path: the model file.
        key_file: a PEM private key (P-256/384/521); default ``DVBENCH_MODEL_SIGNING_KEY``,
            else a fresh key whose private half is discarded after signing.

    Returns:
        The signature (``model.sig``) and public key (``model-signing.pub``) paths.

    Raises:
        ImportError: ``model_signing`` is not installed (``pip install "dvbench[signing]"``).
    """
    try:
        import model_signing
    except ImportError as error:
        raise ImportError(
            f'signing the model needs the model_signing package: pip install "dvbench[signing]" '
            f"({error})"
        ) from error
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    signature = path.parent / SIGNATURE_FILE
    public = path.parent / PUBLIC_KEY_FILE
    configured = key_file or os.environ.get(ENV_MODEL_SIGNING_KEY) or None
    with tempfile.TemporaryDirectory(prefix="dvbench-model-key-") as scratch:
        if configured is not None:
            key_path = Path(configured)
            loaded = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            public_key = loaded.public_key()
        else:
            # Used once: the certificate binds the manifest this key signs.
            fresh = ec.generate_private_key(ec.SECP256R1())
            key_path = Path(scratch) / "key.pem"
            descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(
                    fresh.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    )
                )
            public_key = fresh.public_key()
        model_signing.signing.Config().use_elliptic_key_signer(  # type: ignore[no-untyped-call]
            private_key=key_path
        ).sign(path, signature)
    public.write_bytes(
        public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return signature, public


def copy_model(saved: SavedModel, directory: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Copy the model, its signature and its public key into ``directory``."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    return tuple(
        Path(shutil.copy2(source, target / source.name))
        for source in (saved.path, saved.signature, saved.public_key)
    )
