"""A stored transcript, indexed for challenges, and the names of a proof directory's files."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from django.core.files.storage import default_storage

from attestations.proofs.models import (
    Proof,
)

log = logging.getLogger(__name__)


TRANSCRIPT = "records.cborl"
PROBES = "probes.bin"
FILES_DIR = "files"
REPLAY_DIR = "replay"
COPY_CHUNK = 1024 * 1024
#: Proof-directory names a trainer may attach: the layout zkdv writes.
MAX_NAME = 255


@dataclass
class TranscriptIndex:
    """What the platform reads from a stored transcript to draw and check challenges."""

    root: dict[str, Any]
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    snapshots: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def read(cls, source: str | os.PathLike[str] | bytes) -> TranscriptIndex:
        from zkdv.records import iter_records

        index = cls(root={})
        for record in iter_records(source):
            data = record.data
            kind = data.get("t")
            if kind == "root":
                index.root = data
            elif kind == "step":
                index.steps[int(data["i"])] = data
            elif kind == "snap":
                index.snapshots[int(data["i"])] = data
        return index

    @classmethod
    def of(cls, proof: Proof) -> TranscriptIndex:
        with default_storage.open(proof.transcript.storage_name, "rb") as handle:
            return cls.read(handle.read())

    def snapshot_before(self, step: int) -> int | None:
        candidates = [s for s in self.snapshots if s <= step]
        return max(candidates) if candidates else None

    def specs(self, tree: str) -> list[dict[str, Any]]:
        schema = self.root.get("schema") or {}
        return list(schema.get(tree) or [])

    def tree_bytes(self, tree: str) -> int:
        from zkdv.merkle import LeafSpec

        return sum(LeafSpec.from_dict(spec).nbytes for spec in self.specs(tree))

    @property
    def program_file(self) -> str | None:
        from zkdv import files

        program = self.root.get("program")
        if not isinstance(program, dict):
            return None
        return files.program_file(str(program.get("kind")))

    @property
    def keeps_gradient_files(self) -> bool:
        """Whether the run kept its gradient files (``config.gradient_files``); one that
        did not is replayed by recomputing them bit for bit, and none is requested."""
        config = self.root.get("config") or {}
        return bool(config.get("gradient_files", "always") != "never")

    @property
    def has_probes(self) -> bool:
        return any(step.get("probe") for step in self.steps.values())

    def common_files(self) -> list[str]:
        """Files every replay of this proof reads besides the transcript."""
        names = [self.program_file] if self.program_file else []
        if self.has_probes:
            names.append(PROBES)
        return names

    def files_for(self, step: int, through: int | None) -> list[str]:
        """Proof-directory names a replay of ``step`` (to ``through``) reads.

        State files of an empty tree (no buffers, say) hold no bytes; the platform stores
        no empty blobs, so they are implied and never requested.
        """
        from zkdv.files import TREES

        names = self.common_files()
        start = self.snapshot_before(step)
        if start is None:
            return names
        for tree in TREES:
            if self.tree_bytes(tree):
                names.append(f"{FILES_DIR}/snapshot-{start:08d}.{tree}.bin")
        end = step if through is None else through
        names += [f"{FILES_DIR}/batch-{k:08d}.u32" for k in range(start, end + 1)]
        if self.specs("grad") and self.keeps_gradient_files:
            # A run that commits its gradients: each step's committed computed values.
            names += [f"{FILES_DIR}/grad-{k:08d}.bin" for k in range(start, end + 1)]
        return names

    def steps_to_replay(self, step: int, through: int | None) -> int:
        start = self.snapshot_before(step)
        end = step if through is None else through
        return 0 if start is None else end - start + 1
