"""Data-content queries: did this token window appear in the committed training batches?

An auditor sends a window of exactly the run's rolling-window length (the root record's
``config.rolling_window``) and learns whether it occurs in a committed batch and in which
steps. No training data leaves the platform: the answer is a list of step indices.

How it is answered. Each step record commits its batch by a Merkle root over the rows and
by ``win``, a digest of the sorted multiset of the rolling-window fingerprints
(:mod:`zkdv.batch`). A digest cannot be searched, so the platform answers from the batch
files the trainer attached to the proof (``files/batch-<step>.u32``, see
:class:`~attestations.proofs.models.ProofArtifact`): each file is first checked against its
step's committed root and window digest (a file that does not match is reported and never
searched), then searched exactly with :func:`zkdv.batch.contains_window` (fingerprints,
then a word-by-word comparison). Steps whose batch the platform does not hold are counted,
so an answer says how complete it is.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from attestations.core.errors import ConflictError, InvalidRequestError

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

    from attestations.proofs.models import Proof

__all__ = [
    "MAX_LISTED_STEPS",
    "CommittedBatches",
    "DataQueryResult",
    "committed_batches",
    "query_proof",
    "search_batches",
    "validate_window",
    "verified_key",
]

#: Steps listed in one answer; a window found in more steps is counted, not listed.
MAX_LISTED_STEPS = 1000
BATCH_FILE = re.compile(r"(?:^|/)batch-(\d+)\.u32$")
_VERIFIED_PREFIX = "dvbench:batch-verified:v1"
UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class CommittedBatches:
    """The batch commitments of a transcript: the window length and, per step, root and win."""

    rolling_window: int | None
    roots: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)


def committed_batches(records: Iterable[Any]) -> CommittedBatches:
    """Read the rolling-window length and every step's batch commitment from the records.

    Reading stops at a record the reader cannot decode; the steps before it can still be
    searched. Fields of unexpected types are skipped (a rejected transcript may hold
    them).
    """
    from zkdv.errors import TranscriptError

    window: int | None = None
    roots: dict[int, tuple[bytes, bytes]] = {}
    try:
        for record in records:
            data = record.data
            kind = data.get("t")
            if kind == "step":
                batch, step = data.get("batch"), data.get("i")
                if isinstance(batch, dict) and type(step) is int:
                    root, win = batch.get("root"), batch.get("win")
                    if isinstance(root, bytes) and isinstance(win, bytes):
                        roots[step] = (root, win)
            elif kind == "root":
                config = data.get("config")
                value = config.get("rolling_window") if isinstance(config, dict) else None
                window = value if type(value) is int and value > 0 else None
    except TranscriptError:
        pass
    return CommittedBatches(window, roots)


def validate_window(window: Sequence[int], rolling_window: int | None, proof_id: int) -> None:
    """Refuse a window that is not exactly the committed rolling-window length.

    Raises:
        ConflictError: ``no_rolling_window`` (409), the transcript has no readable root.
        InvalidRequestError: ``window_length`` (400), naming both lengths.
    """
    if rolling_window is None:
        raise ConflictError(
            f"proof {proof_id}'s transcript has no readable root record with a rolling "
            "window (root.config.rolling_window), so it cannot answer data-content queries",
            code="no_rolling_window",
        )
    if len(window) != rolling_window:
        raise InvalidRequestError(
            f"window: expected exactly {rolling_window} tokens, the rolling-window length "
            f"proof {proof_id} committed (root.config.rolling_window); got {len(window)}",
            code="window_length",
            field="window",
            detail={"expected": rolling_window, "got": len(window)},
        )


@dataclass
class DataQueryResult:
    """The answer to one query. Only step indices and counts: never any batch content."""

    window_length: int
    steps: list[int] = field(default_factory=list)
    steps_committed: int = 0
    steps_searched: int = 0
    steps_without_batch: int = 0
    batches_not_matching: list[int] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.steps)

    @property
    def complete(self) -> bool:
        """Every committed step's batch was searched."""
        return self.steps_searched == self.steps_committed

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_length": self.window_length,
            "found": self.found,
            "steps": self.steps[:MAX_LISTED_STEPS],
            "step_count": len(self.steps),
            "steps_truncated": len(self.steps) > MAX_LISTED_STEPS,
            "steps_committed": self.steps_committed,
            "steps_searched": self.steps_searched,
            "steps_without_batch": self.steps_without_batch,
            "batches_not_matching": self.batches_not_matching,
            "complete": self.complete,
        }


def parse_batch(raw: bytes, name: str) -> np.ndarray:
    """A batch file's words (``zkdv.files`` format: rows, cols as u64le, then u32le words)."""
    if len(raw) < 16:
        raise ValueError(f"{name} is too short to be a batch file")
    rows, cols = struct.unpack("<QQ", raw[:16])
    if len(raw) != 16 + rows * cols * 4 or cols == 0:
        raise ValueError(f"{name} declares {rows}x{cols} words but holds {len(raw) - 16} bytes")
    return np.frombuffer(raw, dtype="<u4", offset=16).reshape(rows, cols)


def matches_commitment(batch: np.ndarray, rolling_window: int, root: bytes, win: bytes) -> bool:
    """Whether a batch hashes to a step's committed root and window digest."""
    from zkdv.batch import commit_batch

    commitment = commit_batch(batch, rolling_window)
    return commitment.root == root and commitment.windows == win


def search_batches(
    window: Sequence[int],
    committed: CommittedBatches,
    batches: Iterable[tuple[int, np.ndarray | None]],
    *,
    verified: Mapping[int, bool] | None = None,
) -> DataQueryResult:
    """Search ``window`` in the batches the platform holds (a pure function).

    Args:
        window: the tokens, already of the committed length.
        committed: from :func:`committed_batches`.
        batches: ``(step, words)`` for every stored batch file (None: unreadable).
        verified: steps already known to match (True) or not (False) their commitment.

    Returns:
        The steps in which the window occurs, ascending.
    """
    from zkdv.batch import contains_window

    assert committed.rolling_window is not None
    verified = verified or {}
    needle = np.asarray(window, dtype=np.uint32)
    result = DataQueryResult(len(window), steps_committed=len(committed.roots))
    searched: set[int] = set()
    for step, batch in sorted(batches, key=lambda item: item[0]):
        expected = committed.roots.get(step)
        if expected is None or step in searched:
            continue
        ok = verified.get(step)
        if batch is None:
            ok = False
        elif ok is None:
            ok = matches_commitment(batch, committed.rolling_window, *expected)
        if not ok:
            result.batches_not_matching.append(step)
            continue
        searched.add(step)
        assert batch is not None
        if batch.shape[1] >= needle.size and contains_window(batch, needle):
            result.steps.append(step)
    result.steps_searched = len(searched)
    result.steps_without_batch = (
        len(committed.roots) - len(searched) - len(result.batches_not_matching)
    )
    return result


def verified_key(sha256: str, root: bytes) -> str:
    """The cache key remembering whether the blob ``sha256`` hashes to batch ``root``."""
    return f"{_VERIFIED_PREFIX}:{sha256}:{root.hex()}"


def _stored_batches(proof: Proof) -> list[tuple[int, str, str]]:
    """``(step, blob sha256, storage name)`` of the batch files attached to ``proof``."""
    from attestations.proofs.models import ProofArtifact
    from attestations.uploads.models import ArtifactKind

    found = []
    rows = (
        ProofArtifact.objects.filter(proof=proof, kind=ArtifactKind.BATCH)
        .select_related("blob")
        .order_by("name")
    )
    for artifact in rows:
        match = BATCH_FILE.search(artifact.name)
        if match is not None:
            found.append((int(match.group(1)), artifact.blob.sha256, artifact.blob.storage_name))
    return found


def query_proof(
    proof: Proof,
    window: Sequence[int],
    *,
    actor: User | AnonymousUser | None = None,
    ip: str | None = None,
) -> DataQueryResult:
    """Answer a data-content query on ``proof`` and record it in the audit trail.

    The audit event stores the window's SHA-256 and length, never the window, and the
    answer's counts.

    Raises:
        InvalidRequestError: the window is not of the committed rolling-window length.
    """
    from django.core.cache import cache
    from django.core.files.storage import default_storage

    from attestations.audit.models import AuditEvent
    from zkdv.records import iter_records

    with default_storage.open(proof.transcript.storage_name, "rb") as handle:
        committed = committed_batches(iter_records(handle))
    validate_window(window, committed.rolling_window, proof.pk)
    stored = _stored_batches(proof)
    keys = {
        step: verified_key(sha, committed.roots[step][0])
        for step, sha, _ in stored
        if step in committed.roots
    }
    # A batch file never changes under its digest, so its check against the commitment
    # is done once and remembered.
    cached = cache.get_many(list(keys.values()))
    verified = {step: True for step, key in keys.items() if cached.get(key) is True}

    def load() -> Iterable[tuple[int, np.ndarray | None]]:
        for step, _, name in stored:
            try:
                with default_storage.open(name, "rb") as blob:
                    yield step, parse_batch(blob.read(), name)
            except (OSError, ValueError):
                yield step, None

    result = search_batches(window, committed, load(), verified=verified)
    # Only matches are remembered: a mismatch is a fact about what storage returned this
    # time, not about the digest, and is checked again at the next query.
    fresh = {
        keys[step]: True
        for step in keys
        if step not in verified and step not in result.batches_not_matching
    }
    if fresh:
        cache.set_many(fresh, 30 * 24 * 3600)
    AuditEvent.record(
        "proof.data_query",
        actor=actor,
        organization=proof.experiment.owner,
        target=proof,
        detail={
            "experiment": proof.experiment.full_name,
            "window_length": len(window),
            "window_sha256": hashlib.sha256(np.asarray(window, dtype="<u4").tobytes()).hexdigest(),
            "found": result.found,
            "step_count": len(result.steps),
            "steps_searched": result.steps_searched,
            "steps_committed": result.steps_committed,
        },
        ip=ip,
    )
    return result
