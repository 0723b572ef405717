"""A proof directory's sync manifest, ``dvbench-sync.json``, and the files it accounts for.

The manifest names the experiment the proof belongs to and records how far each file has
reached the platform; the uploader (``dvbench._sync``) rewrites it atomically after every
step. Here too: which files of a proof directory are uploaded, and as which artifact kind
(:func:`kind_of`); a manifest for a directory written by zkdv alone
(:func:`adopt_directory`); and the directories under the cache still waiting for
``dvbench sync`` (:func:`pending_directories`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dvbench._exceptions import UploadError

__all__ = [
    "LOCK",
    "MANIFEST",
    "TRANSCRIPT",
    "Manifest",
    "adopt_directory",
    "kind_of",
    "pending_directories",
    "sha256_file",
    "utc_timestamp",
]

MANIFEST = "dvbench-sync.json"
LOCK = ".dvbench-sync.lock"
FORMAT = "dvbench.sync/v1"
TRANSCRIPT = "records.cborl"
HASH_CHUNK = 1024 * 1024


def kind_of(relative: str) -> str | None:
    """The platform's artifact kind for a file of a proof directory (None: not uploaded)."""
    name = relative.rsplit("/", 1)[-1]
    if name.endswith((".partial", ".tmp")) or name in (MANIFEST, LOCK):
        return None
    if relative == TRANSCRIPT:
        return "transcript"
    if relative.startswith("files/"):
        if name.startswith("snapshot-") and name.endswith(".bin"):
            return "snapshot"
        if name.startswith("batch-") and name.endswith(".u32"):
            return "batch"
        if name.startswith("grad-") and name.endswith(".bin"):
            return "gradient"
        return None
    if relative == "probes.bin" or name.startswith("program."):
        return "artifact"
    # The final model (DVBenchProof.save_model): weights, signature, public key.
    model_file = name.endswith(".safetensors") or name in ("model.sig", "model-signing.pub")
    if relative.startswith("model/") and relative.count("/") == 1 and model_file:
        return "artifact"
    return None


def utc_timestamp() -> str:
    """Now, as the manifest records times: ISO 8601 in UTC, whole seconds."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Manifest:
    """``dvbench-sync.json``: the experiment a proof belongs to, and each file's upload state.

    Attributes:
        data: the JSON document; ``files`` maps a relative path to
            ``{kind, size, sha256, mtime_ns, status, upload_id, part_size, parts}``
            where ``status`` is ``pending``, ``uploading``, ``complete``,
            ``deduplicated`` or ``empty`` and ``parts`` maps part numbers to digests sent.
    """

    def __init__(self, directory: Path, data: dict[str, Any]) -> None:
        self.directory = directory
        self.path = directory / MANIFEST
        self.data = data
        self._lock = threading.RLock()

    @classmethod
    def create(
        cls,
        directory: Path,
        *,
        experiment: str,
        spec_digest: str,
        backend: str | None,
        base_url: str | None,
        ephemeral: bool,
        spec: dict[str, Any] | None = None,
    ) -> Manifest:
        manifest = cls(
            directory,
            {
                "format": FORMAT,
                "experiment": experiment,
                "spec_digest": spec_digest,
                "spec": spec,
                "backend": backend,
                "base_url": base_url,
                "ephemeral": ephemeral,
                "finished": False,
                "created": utc_timestamp(),
                "files": {},
                "proof": None,
                "attached": None,
                "synced": None,
            },
        )
        manifest.save()
        return manifest

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UploadError(
                f"{directory} has no {MANIFEST}: it is not a proof directory written by "
                "dvbench (a proof made with zkdv alone: `dvbench sync DIR --experiment "
                "owner/name`)",
                directory=str(directory),
            ) from None
        except ValueError as error:
            raise UploadError(
                f"{path} is not valid JSON: {error}", directory=str(directory)
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UploadError(f"{path} is not a {FORMAT} manifest", directory=str(directory))
        return cls(directory, data)

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.data.setdefault("files", {})
        return files

    @property
    def experiment(self) -> str:
        return str(self.data["experiment"])

    def save(self) -> None:
        """Write atomically: a crash leaves the previous or the new manifest, never half."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}")
            temporary.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            os.replace(temporary, self.path)

    def update(self, **values: Any) -> None:
        with self._lock:
            self.data.update(values)
            self.save()

    def change(self, entry: dict[str, Any], *, drop: tuple[str, ...] = (), **values: Any) -> None:
        """Change one file's entry and save, under the lock: uploader threads share it."""
        with self._lock:
            for key in drop:
                entry.pop(key, None)
            entry.update(values)
            self.save()

    def add_part(self, entry: dict[str, Any], number: int, digest: str) -> None:
        with self._lock:
            entry.setdefault("parts", {})[str(number)] = digest
            self.save()

    def put(self, relative: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self.files[relative] = entry
            self.save()


def adopt_directory(directory: Path, experiment: str, base_url: str) -> None:
    """Write a manifest for a proof directory written by zkdv without dvbench."""
    from zkdv.records import iter_records

    transcript = directory / TRANSCRIPT
    if not transcript.is_file():
        raise UploadError(f"{directory} holds no {TRANSCRIPT}", directory=str(directory))
    with open(transcript, "rb") as handle:
        first = next(iter_records(handle.read(16 * 1024 * 1024)), None)
    root = first.data if first is not None and isinstance(first.data, dict) else {}
    bound = root.get("experiment") if isinstance(root.get("experiment"), dict) else None
    if not bound or bound.get("name") != experiment:
        raise UploadError(
            f"{transcript} is bound to experiment "
            f"{(bound or {}).get('name')!r}, not {experiment!r}: a transcript can only be "
            "filed under the experiment it was bound to before its first step",
            directory=str(directory),
        )
    manifest = Manifest.create(
        directory,
        experiment=experiment,
        spec_digest=str(bound.get("spec_digest") or ""),
        backend=str(root.get("prover", "")).removeprefix("whitebox-") or None,
        base_url=base_url,
        ephemeral=False,
    )
    manifest.update(finished=True)


def pending_directories(root: Path, *, finished: bool | None = None) -> list[Path]:
    """Proof directories under ``root`` (the cache's ``runs/``) not yet fully synced.

    Args:
        finished: only runs whose ``finish()`` closed the transcript (True), only runs
            that never got there (False), or both (None).
    """
    if not root.is_dir():
        return []
    found = []
    for manifest in sorted(root.rglob(MANIFEST)):
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("synced"):
            continue
        if finished is None or bool(data.get("finished")) == finished:
            found.append(manifest.parent)
    return found
