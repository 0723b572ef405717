"""What a sync of a proof directory did: :class:`SyncResult`.

Returned by ``dvbench sync``, :meth:`dvbench.Client.sync` and
:meth:`DVBenchProof.finish`; the uploader counts into it as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dvbench._progress import format_bytes

if TYPE_CHECKING:
    from dvbench._verdict import Verdict

__all__ = ["SyncResult"]


@dataclass
class SyncResult:
    """What a sync (or :meth:`DVBenchProof.finish`) did.

    Attributes:
        directory: the proof directory (removed afterwards if ``released``).
        experiment: ``owner/name``.
        proof_id: the platform's id of the filed proof, once the transcript is uploaded.
        complete: every file, the transcript included, is on the platform.
        offline: nothing was sent (offline mode); ``directory`` waits for ``dvbench sync``.
        verdict: the proof's :class:`~dvbench.Verdict` when it was asked for (PASSED,
            FAILED with the failed claims, pending, error); None before the proof is filed.
    """

    directory: Path
    experiment: str
    proof_id: int | None = None
    proof_url: str | None = None
    complete: bool = False
    offline: bool = False
    released: bool = False
    attached: bool | None = None
    files_uploaded: int = 0
    files_deduplicated: int = 0
    challenged_files: int | None = None
    bytes_sent: int = 0
    bytes_deduplicated: int = 0
    bytes_resumed: int = 0
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None

    def summary(self) -> str:
        if self.offline:
            return (
                f"dvbench: offline; proof of {self.experiment} kept in {self.directory}\n"
                f"  upload it later with: dvbench sync {self.directory}"
            )
        text = (
            f"dvbench: {self.experiment}: sent {self.files_uploaded} file(s), "
            f"{format_bytes(self.bytes_sent)}"
        )
        if self.files_deduplicated:
            text += (
                f"; {self.files_deduplicated} already on the platform "
                f"({format_bytes(self.bytes_deduplicated)} deduplicated)"
            )
        if self.bytes_resumed:
            text += f"; resumed {format_bytes(self.bytes_resumed)}"
        if self.challenged_files is not None:
            text += f"; answered challenges with {self.challenged_files} file(s)"
        if self.proof_id is not None:
            text += f"; proof {self.proof_id}"
            if self.proof_url:
                text += f" at {self.proof_url}"
        if self.verdict is not None:
            text += "\n" + self.verdict.summary()
        return text
