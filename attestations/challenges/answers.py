"""Answering challenges: the files a trainer attaches, each checked before it is stored.

:func:`attach` checks every file against what the transcript commits for it (state roots,
batch roots, the program digest, the final model); a challenge whose files are all there
is ``ready`` (:func:`mark_ready`) and queued on the ``replay`` queue (:func:`enqueue`).
"""

from __future__ import annotations

import functools
import logging
import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
from celery import current_app
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    ArtifactRejectedError,
)
from attestations.challenges.index import FILES_DIR, MAX_NAME, PROBES, TranscriptIndex
from attestations.challenges.models import (
    Challenge,
    ChallengeStatus,
)
from attestations.challenges.routing import queue_or_unreplayed
from attestations.proofs.model_files import check_weights, model_names
from attestations.proofs.models import (
    Proof,
    ProofArtifact,
)
from attestations.uploads.blobs import mapped
from attestations.uploads.models import ArtifactKind, Blob, UploadStatus

if TYPE_CHECKING:
    from zkdv.merkle import LeafSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileClaim:
    """One file of an artifact list: ``{name, kind, sha256, size}``."""

    name: str
    kind: str
    sha256: str
    size: int


def check_name(name: str, kind: str, position: int) -> str:
    """A proof-directory name: relative, normalised, in zkdv's layout for its kind."""
    where = f"files[{position}].name"
    path = PurePosixPath(name)
    if (
        not name
        or len(name) > MAX_NAME
        or "\\" in name
        or "\0" in name
        or path.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise ArtifactRejectedError(
            f"{where}: {name!r} is not a relative path inside the proof directory",
            code="invalid_name",
            field=where,
        )
    if kind not in (
        ArtifactKind.SNAPSHOT,
        ArtifactKind.BATCH,
        ArtifactKind.GRADIENT,
        ArtifactKind.ARTIFACT,
    ):
        raise ArtifactRejectedError(
            f"files[{position}].kind: {kind!r} cannot be attached; expected one of "
            "artifact, snapshot, batch, gradient (the transcript is the proof itself)",
            code="invalid_kind",
            field=f"files[{position}].kind",
        )
    if not _in_layout(name, kind):
        raise ArtifactRejectedError(
            f"{where}: {name!r} is not where zkdv writes a file of kind {kind!r}",
            code="invalid_name",
            field=where,
        )
    return name


def _in_layout(name: str, kind: str) -> bool:
    """Whether ``name`` is where zkdv writes a file of ``kind``."""
    base = name.removeprefix(f"{FILES_DIR}/")
    in_files = name.startswith(f"{FILES_DIR}/") and "/" not in base
    if kind == ArtifactKind.SNAPSHOT:
        return in_files and base.startswith("snapshot-") and base.endswith(".bin")
    if kind == ArtifactKind.BATCH:
        return in_files and base.startswith("batch-") and base.endswith(".u32")
    if kind == ArtifactKind.GRADIENT:
        return in_files and base.startswith("grad-") and base.endswith(".bin")
    if model_names(name):
        return True  # the final model (dvbench's proof.save_model), bound by the certificate
    return "/" not in name and (name == PROBES or name.startswith("program."))


#: Why a file does not match its commitment: ``(code, message, detail)``.
_Mismatch = tuple[str, str, dict[str, Any]]


def _commitment_check(
    index: TranscriptIndex, name: str, data: bytes | mmap.mmap
) -> _Mismatch | None:
    """Check a file against what the transcript commits for it.

    Returns:
        None when it matches (or the transcript commits nothing for it), else
        ``(code, message, detail)``.
    """
    base = name.rsplit("/", 1)[-1]
    if name == index.program_file:
        return _program_check(index, name, data)
    if base.startswith("snapshot-"):
        return _snapshot_check(index, name, base, data)
    if base.startswith("grad-"):
        return _gradient_check(index, name, base, data)
    if base.startswith("batch-"):
        return _batch_check(index, name, base, data)
    return None


def _leaves(specs: Sequence[LeafSpec], data: bytes | mmap.mmap) -> list[tuple[str, np.ndarray]]:
    """The little-endian arrays a state file holds, one per leaf spec, in order."""
    raw = np.frombuffer(data, dtype=np.uint8)
    leaves, offset = [], 0
    for spec in specs:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        leaves.append(
            (spec.path, raw[offset : offset + spec.nbytes].view(dtype).reshape(spec.shape))
        )
        offset += spec.nbytes
    return leaves


def _program_check(index: TranscriptIndex, name: str, data: bytes | mmap.mmap) -> _Mismatch | None:
    """The attested program against the root record's program digest."""
    from zkdv.hashing import Domain, hash_bytes

    program = index.root.get("program") or {}
    if hash_bytes(Domain.FILE, memoryview(data)) != program.get("digest"):
        return (
            "program_mismatch",
            f"{name} ({len(data)} bytes) does not hash to the program digest the "
            "transcript's root record commits",
            {"file": name},
        )
    return None


def _snapshot_check(
    index: TranscriptIndex, name: str, base: str, data: bytes | mmap.mmap
) -> _Mismatch | None:
    """A state snapshot (``files/snapshot-<step>.<tree>.bin``) against its committed root."""
    from zkdv.config import ZKDVConfig
    from zkdv.merkle import LeafSpec, commit_state

    try:
        step_text, tree, _ = base.removeprefix("snapshot-").split(".")
        step = int(step_text)
    except ValueError:
        return ("unknown_file", f"{name} is not a snapshot file name", {"file": name})
    snap = index.snapshots.get(step)
    if snap is None or tree not in ("params", "opt_state", "buffers"):
        return (
            "unknown_file",
            f"{name}: the transcript records no snapshot of {tree} at step {step}",
            {"file": name, "step": step},
        )
    specs = [LeafSpec.from_dict(spec) for spec in index.specs(tree)]
    expected_size = sum(spec.nbytes for spec in specs)
    if len(data) != expected_size:
        return (
            "snapshot_mismatch",
            f"{name} holds {len(data)} bytes; the schema of {tree} needs {expected_size}",
            {"file": name, "step": step, "expected_size": expected_size},
        )
    chunk = ZKDVConfig.from_dict(index.root["config"]).chunk_bytes
    leaves = _leaves(specs, data)
    key = {"params": "p", "opt_state": "o", "buffers": "b"}[tree]
    if commit_state(leaves, chunk).root != snap["roots"][key]:
        return (
            "snapshot_mismatch",
            f"{name} does not hash to the {tree} root the transcript commits for step {step}",
            {"file": name, "step": step},
        )
    return None


def _batch_check(
    index: TranscriptIndex, name: str, base: str, data: bytes | mmap.mmap
) -> _Mismatch | None:
    """A step's batch (``files/batch-<step>.u32``) against its committed batch root."""
    import struct

    from zkdv.batch import commit_batch

    try:
        step = int(base.removeprefix("batch-").removesuffix(".u32"))
    except ValueError:
        return ("unknown_file", f"{name} is not a batch file name", {"file": name})
    record = index.steps.get(step)
    if record is None:
        return (
            "unknown_file",
            f"{name}: the transcript has no step {step}",
            {"file": name, "step": step},
        )
    if len(data) < 16:
        return ("batch_mismatch", f"{name} is too short to be a batch file", {"file": name})
    rows, cols = struct.unpack("<QQ", data[:16])
    if len(data) != 16 + rows * cols * 4:
        return (
            "batch_mismatch",
            f"{name} declares {rows}x{cols} words but holds {len(data) - 16} bytes",
            {"file": name, "step": step},
        )
    batch = np.frombuffer(data, dtype="<u4", offset=16).reshape(rows, cols)
    window = int(index.root["config"]["rolling_window"])
    if commit_batch(batch, window).root != record["batch"]["root"]:
        return (
            "batch_mismatch",
            f"{name} does not hash to step {step}'s committed batch root",
            {"file": name, "step": step},
        )
    return None


def _gradient_check(
    index: TranscriptIndex, name: str, base: str, data: bytes | mmap.mmap
) -> _Mismatch | None:
    """A step's computed values (``files/grad-<step>.bin``) against its ``grad`` root."""
    from zkdv.config import ZKDVConfig
    from zkdv.merkle import LeafSpec, commit_state

    try:
        step = int(base.removeprefix("grad-").removesuffix(".bin"))
    except ValueError:
        return ("unknown_file", f"{name} is not a gradient file name", {"file": name})
    record = index.steps.get(step)
    specs = [LeafSpec.from_dict(spec) for spec in index.specs("grad")]
    if record is None or "grad" not in record:
        return (
            "unknown_file",
            f"{name}: the transcript commits no computed values for step {step}",
            {"file": name, "step": step},
        )
    expected_size = sum(spec.nbytes for spec in specs)
    if len(data) != expected_size:
        return (
            "gradient_mismatch",
            f"{name} holds {len(data)} bytes; the root's schema.grad needs {expected_size}",
            {"file": name, "step": step, "expected_size": expected_size},
        )
    leaves = _leaves(specs, data)
    chunk = ZKDVConfig.from_dict(index.root["config"]).chunk_bytes
    if commit_state(leaves, chunk).root != record["grad"]:
        return (
            "gradient_mismatch",
            f"{name} does not hash to step {step}'s committed grad root",
            {"file": name, "step": step},
        )
    return None


def _needed(proof: Proof) -> set[str]:
    names: set[str] = set()
    for files in proof.challenges.values_list("needed_files", flat=True):
        names.update(files or [])
    return names


def attach(
    proof: Proof, claims: Sequence[FileClaim], *, user: User | None, ip: str | None = None
) -> tuple[list[ProofArtifact], int]:
    """Attach uploaded files to a proof; all or nothing.

    Each file must be a completed upload (a blob) of this organisation's experiment.
    Files a challenge needs are checked against the transcript's commitments. Attaching
    a file again with the same digest is a no-op; with another digest, a 409.

    Returns:
        The proof's artifacts named in the request, and how many were newly stored.

    Raises:
        ArtifactRejectedError, ArtifactConflictError, ArtifactMismatchError: the first
            bad file (a malformed list, a name attached with other bytes, a file that
            does not match its commitment); nothing was stored.
    """
    _check_names(claims)
    blobs = _owned_blobs(proof, claims)
    existing = {a.name: a for a in proof.artifacts.all()}
    needed = _needed(proof)
    index = functools.cache(lambda: TranscriptIndex.of(proof))  # read only if needed
    fresh: list[ProofArtifact] = []
    for position, claim in enumerate(claims):
        blob = blobs[claim.sha256]
        if _attached_before(proof, position, claim, blob, existing.get(claim.name)):
            continue
        _check_content(proof, position, claim, blob, needed, index)
        fresh.append(
            ProofArtifact(
                proof=proof,
                name=claim.name,
                kind=claim.kind,
                blob=blob,
                sha256=claim.sha256,
                size=claim.size,
                created_by=user,
            )
        )
    with transaction.atomic():
        ProofArtifact.objects.bulk_create(fresh, ignore_conflicts=True)
        if fresh:
            AuditEvent.record(
                "proof.artifacts_attached",
                actor=user,
                organization=proof.experiment.owner,
                target=proof,
                detail={"files": [a.name for a in fresh], "count": len(fresh)},
                ip=ip,
            )
        mark_ready(proof)
    names = [claim.name for claim in claims]
    return list(proof.artifacts.filter(name__in=names).select_related("blob")), len(fresh)


def _check_names(claims: Sequence[FileClaim]) -> None:
    """Every name is one a proof's file may have, and none is listed twice."""
    names_seen: dict[str, int] = {}
    for position, claim in enumerate(claims):
        check_name(claim.name, claim.kind, position)
        if claim.name in names_seen:
            raise ArtifactRejectedError(
                f"files[{position}].name: {claim.name!r} is listed twice "
                f"(also files[{names_seen[claim.name]}])",
                code="duplicate_name",
                field=f"files[{position}].name",
            )
        names_seen[claim.name] = position


def _attached_before(
    proof: Proof, position: int, claim: FileClaim, blob: Blob, known: ProofArtifact | None
) -> bool:
    """Whether the file is attached already (the same bytes); a size that is not the
    blob's, or a name attached with other bytes, is refused."""
    if blob.size != claim.size:
        raise ArtifactRejectedError(
            f"files[{position}].size: {claim.name} declares {claim.size} bytes; the stored "
            f"blob sha256:{claim.sha256} has {blob.size}",
            code="size_mismatch",
            field=f"files[{position}].size",
            detail={"expected": blob.size, "got": claim.size},
        )
    if known is None:
        return False
    if known.sha256 != claim.sha256:
        raise ArtifactConflictError(
            f"files[{position}]: {claim.name} is already attached to proof {proof.pk} "
            f"with sha256 {known.sha256}; a proof's files never change",
            code="artifact_conflict",
            field=f"files[{position}].sha256",
            detail={"attached": known.sha256, "got": claim.sha256},
        )
    return True


def _check_content(
    proof: Proof,
    position: int,
    claim: FileClaim,
    blob: Blob,
    needed: set[str],
    index: Callable[[], TranscriptIndex],
) -> None:
    """A new file's bytes against what the transcript commits: the final weights against
    its final parameters, a file a challenge needs against its commitment."""
    if claim.name.endswith(".safetensors"):
        # The final weights must be the transcript's final parameters (checked again
        # when the certificate is issued, should the proof not be verified yet).
        problem_text = check_weights(proof, claim.name, blob.storage_name, blob.size)
        if problem_text is not None:
            raise ArtifactMismatchError(
                f"files[{position}]: {problem_text}",
                code="model_mismatch",
                field=f"files[{position}].sha256",
                detail={"file": claim.name},
            )
    if claim.name in needed or claim.name.startswith("program."):
        with mapped(blob.storage_name) as data:
            problem = _commitment_check(index(), claim.name, data)
        if problem is not None:
            code, message, detail = problem
            raise ArtifactMismatchError(
                f"files[{position}]: {message}",
                code=code,
                field=f"files[{position}].sha256",
                detail=detail,
            )


def owned_blobs(organization_id: int, digests: Iterable[str]) -> dict[str, Blob]:
    """The blobs named by digest that a completed upload of the organisation stored.

    A digest alone names no bytes a lab may use: another organisation's blob with the
    same digest is not this one's until it uploads the bytes itself.
    """
    return {
        blob.sha256: blob
        for blob in Blob.objects.filter(
            sha256__in=set(digests),
            uploads__status=UploadStatus.COMPLETE,
            uploads__organization_id=organization_id,
        ).distinct()
    }


def _owned_blobs(proof: Proof, claims: Sequence[FileClaim]) -> dict[str, Blob]:
    """The blobs named by digest, each completed by an upload of this organisation."""
    owned = owned_blobs(proof.experiment.owner_id, (claim.sha256 for claim in claims))
    for position, claim in enumerate(claims):
        if claim.sha256 not in owned:
            raise ArtifactRejectedError(
                f"files[{position}].sha256: no completed upload of {proof.experiment.owner.slug} "
                f"has sha256 {claim.sha256} ({claim.name}); upload it first",
                code="blob_not_found",
                field=f"files[{position}].sha256",
            )
    return owned


def mark_ready(proof: Proof) -> list[int]:
    """Move pending challenges whose files are all attached to ``ready``, and queue them.

    The queueing happens on commit, so a worker never sees a challenge the database
    does not yet show as ready.
    """
    attached = set(proof.artifacts.values_list("name", flat=True))
    ready: list[int] = []
    now = timezone.now()
    for challenge in proof.challenges.filter(status=ChallengeStatus.PENDING):
        if set(challenge.needed_files) <= attached:
            moved = Challenge.objects.filter(
                pk=challenge.pk, status=ChallengeStatus.PENDING
            ).update(status=ChallengeStatus.READY, answered=now)
            if moved:
                ready.append(challenge.pk)
    if ready:
        transaction.on_commit(lambda: enqueue(ready))
    return ready


#: The Celery task that replays one challenge (``attestations.challenges.tasks``). It is
#: sent by name: the tasks run this module's stages, so importing them here would loop.
REPLAY_TASK = "attestations.challenges.tasks.replay_challenge"


def enqueue(challenge_ids: Iterable[int]) -> None:
    """Queue each challenge's replay on the replay queue of its run's platform kind (in
    process when tasks run eagerly), recording the task id on the challenge.

    :func:`~attestations.challenges.routing.queue_or_unreplayed` picks the queue; a
    challenge no worker can replay is recorded ``unreplayed`` instead.
    """
    by_proof: dict[int, list[int]] = {}
    for challenge_id, proof_id in Challenge.objects.filter(pk__in=list(challenge_ids)).values_list(
        "pk", "proof_id"
    ):
        by_proof.setdefault(proof_id, []).append(challenge_id)
    for proof_id, ids in sorted(by_proof.items()):
        queue = queue_or_unreplayed(Proof.objects.get(pk=proof_id), sorted(ids))
        if queue is None:
            continue
        for challenge_id in sorted(ids):
            task = current_app.signature(REPLAY_TASK, args=(challenge_id,))
            result = task.apply_async(queue=queue)
            Challenge.objects.filter(pk=challenge_id).update(task_id=str(result.id))
