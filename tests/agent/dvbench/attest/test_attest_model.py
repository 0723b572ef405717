"""The final model: safetensors written and read strictly, checked against the state root, signed."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dvbench._model import (
    ModelMismatchError,
    SafetensorsError,
    check_final_parameters,
    read_safetensors,
    sign_model,
    write_safetensors,
)
from dvbench.attest import model_signature_subject
from zkdv.merkle import LeafSpec, commit_state

CHUNK = 256
LEAVES = [
    ("params['w']", np.arange(12, dtype=np.float32).reshape(3, 4) / 7),
    ("params['b']", np.array([0.5, -1.25, 3.0], dtype=np.float32)),
]
SPECS = [LeafSpec.of(path, array).to_dict() for path, array in LEAVES]
ROOT = commit_state(LEAVES, CHUNK).root.hex()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "model.safetensors"
    write_safetensors(path, LEAVES, {"zkdv.final_parameter_root": ROOT})
    return path


def _check(data: bytes) -> None:
    check_final_parameters(
        io.BytesIO(data), len(data), specs=SPECS, chunk_bytes=CHUNK, final_root=ROOT
    )


def test_the_safetensors_library_reads_what_we_write(model: Path) -> None:
    from safetensors.numpy import load_file

    loaded = load_file(str(model))
    assert list(loaded) == [path for path, _ in LEAVES] or set(loaded) == {p for p, _ in LEAVES}
    for path, array in LEAVES:
        np.testing.assert_array_equal(loaded[path], array)


def test_the_weights_are_checked_against_the_final_root(model: Path) -> None:
    data = model.read_bytes()
    _check(data)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(ModelMismatchError, match="not to the final parameter root"):
        _check(bytes(flipped))


def test_other_tensors_are_named_precisely(tmp_path: Path) -> None:
    renamed = tmp_path / "renamed.safetensors"
    write_safetensors(renamed, [("params['v']", LEAVES[0][1]), LEAVES[1]])
    with pytest.raises(ModelMismatchError, match=r"missing params\['w'\].*not in the schema"):
        _check(renamed.read_bytes())
    widened = tmp_path / "widened.safetensors"
    write_safetensors(widened, [(LEAVES[0][0], LEAVES[0][1].astype(np.float64)), LEAVES[1]])
    with pytest.raises(ModelMismatchError, match=r"float64.*commits float32"):
        _check(widened.read_bytes())


@pytest.mark.parametrize(
    ("mangle", "words"),
    [
        (lambda d: d[:4], "8-byte header length"),
        (lambda d: struct.pack("<Q", 10**9) + d[8:], "header claims"),
        (lambda d: d + b"\0", "cover"),
        (lambda d: d[:-1], "cover"),
        (lambda d: d[:8] + b"[" + d[9:], "not JSON"),
    ],
)
def test_malformed_files_are_refused(model: Path, mangle: object, words: str) -> None:
    data = mangle(model.read_bytes())  # type: ignore[operator]
    with pytest.raises(SafetensorsError, match=words):
        list(read_safetensors(io.BytesIO(data), len(data)))


def test_overlapping_tensors_are_refused() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * 4
    with pytest.raises(SafetensorsError, match="gaps and overlaps"):
        list(read_safetensors(io.BytesIO(data), len(data)))


def test_model_signing_verifies_the_signed_model_and_not_a_changed_one(model: Path) -> None:
    signature, public = sign_model(model)
    name, manifest = model_signature_subject(signature.read_bytes())
    assert name == model.name and len(manifest) == 64
    tool = Path(sys.executable).parent / "model_signing"
    command = [str(tool), "verify", "key", model.name, "--signature", signature.name]
    command += ["--public_key", public.name]
    done = subprocess.run(command, cwd=model.parent, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    done = subprocess.run(command, cwd=model.parent, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "Verification failed" in done.stderr, done
