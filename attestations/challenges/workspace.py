"""The proof directory a replay reads: materialised from blobs under ``DATA_DIR/replay/``."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.core.files.storage import default_storage

from attestations.challenges.index import (
    COPY_CHUNK,
    FILES_DIR,
    REPLAY_DIR,
    TRANSCRIPT,
    TranscriptIndex,
)
from attestations.proofs.models import (
    Proof,
)
from attestations.uploads.models import Blob

log = logging.getLogger(__name__)


def data_dir() -> Path:
    return Path(settings.DVBENCH["DATA_DIR"])


def proof_directory(proof: Proof, names: Iterable[str]) -> Path:
    """The proof directory under ``DATA_DIR/replay/``, with the transcript and ``names``.

    Each file is copied from its blob once (a cache shared by the challenges of the
    proof), through a unique temporary name and an atomic rename, so two workers
    materialising the same proof never see half a file. Empty state files, which no
    blob stores, are created from the schema.
    """
    directory = data_dir() / REPLAY_DIR / f"proof-{proof.pk}-{proof.transcript.sha256[:16]}"
    (directory / FILES_DIR).mkdir(parents=True, exist_ok=True)
    _materialise(directory / TRANSCRIPT, proof.transcript)
    artifacts = {a.name: a for a in proof.artifacts.select_related("blob")}
    for name in names:
        artifact = artifacts.get(name)
        if artifact is not None:
            _materialise(directory / name, artifact.blob)
    _empty_trees(proof, directory)
    return directory


def _empty_trees(proof: Proof, directory: Path) -> None:
    """Create the zero-byte state files of empty trees (no blob holds an empty file)."""
    from zkdv.files import TREES

    starts = {path.name.split(".")[0] for path in directory.glob(f"{FILES_DIR}/snapshot-*.bin")}
    missing = [
        directory / FILES_DIR / f"{start}.{tree}.bin"
        for start in starts
        for tree in TREES
        if not (directory / FILES_DIR / f"{start}.{tree}.bin").exists()
    ]
    if not missing:
        return
    index = TranscriptIndex.of(proof)
    for path in missing:
        tree = path.name.split(".")[1]
        if index.tree_bytes(tree) == 0:
            path.touch()


class BlobCorruptError(RuntimeError):
    """A stored blob no longer hashes to its address: storage damage, not a retry case."""


def _materialise(target: Path, blob: Blob) -> None:
    if target.exists() and target.stat().st_size == blob.size:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
    digest = hashlib.sha256()
    try:
        with default_storage.open(blob.storage_name, "rb") as source, open(temporary, "wb") as out:
            while chunk := source.read(COPY_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != blob.sha256:
            raise BlobCorruptError(
                f"{target.name}: stored blob sha256:{blob.sha256} reads back as "
                f"sha256:{digest.hexdigest()}"
            )
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def release_directory(proof: Proof) -> None:
    """Remove a proof's materialised directory once its verdict is final."""
    directory = data_dir() / REPLAY_DIR / f"proof-{proof.pk}-{proof.transcript.sha256[:16]}"
    shutil.rmtree(directory, ignore_errors=True)


#: Loaded transitions of recent proofs: ``(transcript sha256) -> transition``. Loading
#: the attested program is the one-time cost of a proof; its other challenges reuse it.
