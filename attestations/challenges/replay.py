"""Server-side replay: challenges, the files that answer them, and the replay verdicts.

The life of a proof after the offline verifier accepted its transcript:

1. :func:`draw` derives a seed the trainer cannot predict or re-roll (HMAC under the
   organisation's secret key of the committed run's digest), derives the challenged
   steps from it (:func:`provers.challenges.draw_challenges`: step 0, every step the
   trainer self-checked, random steps up to this filing's detection target), stores
   only the seed's SHA-256 where users can see it, and lists for each challenge the
   proof-directory files its replay reads. The proof is ``challenged``.
2. The trainer answers by uploading those files and attaching them
   (:func:`attach`): each one is checked against what the transcript commits for it
   (state roots, batch roots, the program digest) before anything is stored.
3. A challenge whose files are all there is ``ready`` and queued for the ``replay``
   queue; :func:`run_challenge` claims it (a conditional update, so it completes once),
   materialises the proof directory under ``DATA_DIR`` and runs
   :func:`provers.verify_challenge`.
4. :func:`settle` gives the proof its verdict once every challenge is final: ``valid``
   iff all passed, else ``rejected`` with the first failing challenge's reason and step;
   the seed is revealed and the certificate task queued.

Unanswered challenges expire at the deadline (:func:`expire`), which rejects the proof.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    ArtifactRejectedError,
)
from attestations.challenges.models import (
    CHALLENGE_FINAL,
    Challenge,
    ChallengeOrigin,
    ChallengeStatus,
)
from attestations.core.db import take_claim, task_time_limit
from attestations.proofs.model_files import check_weights, model_names
from attestations.proofs.models import (
    DUPLICATE_TRANSCRIPT,
    Job,
    JobStatus,
    Proof,
    ProofArtifact,
    ProofStatus,
)
from attestations.uploads.models import ArtifactKind, Blob, UploadStatus

log = logging.getLogger(__name__)

TRANSCRIPT = "records.cborl"
PROBES = "probes.bin"
FILES_DIR = "files"
REPLAY_DIR = "replay"
COPY_CHUNK = 1024 * 1024
#: Proof-directory names a trainer may attach: the layout zkdv writes.
MAX_NAME = 255


# --- Settings -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChallengePolicy:
    """The detection target, the forged fraction it is computed for, and the answer TTL."""

    target: float
    forged_fraction: float
    ttl: timedelta

    @classmethod
    def from_settings(cls) -> ChallengePolicy:
        knobs: Mapping[str, Any] = settings.DVBENCH
        return cls(
            target=float(knobs["DETECTION_TARGET"]),
            forged_fraction=float(knobs["FORGED_FRACTION"]),
            ttl=timedelta(seconds=int(knobs["CHALLENGE_TTL_SECONDS"])),
        )


def replay_time_limit() -> int:
    """Seconds after which a ``replaying`` claim is stale (its worker died)."""
    return int(task_time_limit().total_seconds())


# --- The transcript, indexed for challenges ------------------------------------------------


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
        from zkdv.driver import PROGRAM_FILES

        program = self.root.get("program")
        if not isinstance(program, dict):
            return None
        return PROGRAM_FILES.get(str(program.get("kind")), "program.bin")

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
        return names

    def steps_to_replay(self, step: int, through: int | None) -> int:
        start = self.snapshot_before(step)
        end = step if through is None else through
        return 0 if start is None else end - start + 1


# --- Drawing ------------------------------------------------------------------------------


def replayable(root: Mapping[str, Any] | None) -> bool:
    """Whether a transcript commits a program a replay prover can run."""
    from provers import PROVERS

    if not isinstance(root, Mapping) or root.get("prover") not in PROVERS:
        return False
    program = root.get("program")
    return isinstance(program, Mapping) and bool(program.get("kind"))


#: What the seed of a committed run is derived with (HMAC-SHA256 under the organisation's key).
SEED_CONTEXT = b"dvbench-challenge-seed-v2\0"
#: Prefix of the committed-run digest.
RUN_CONTEXT = b"dvbench-run-v1\0"


def _absorb(h: Any, value: object) -> None:
    """Feed one field, unambiguously: a type tag, a length, the bytes."""
    if isinstance(value, bytes | bytearray):
        data, tag = bytes(value), b"B"
    elif value is None:
        data, tag = b"", b"N"
    else:
        data, tag = repr(value).encode("utf-8"), b"R"
    h.update(tag + len(data).to_bytes(8, "little") + data)


def run_digest(index: TranscriptIndex) -> str:
    """SHA-256 (hex) of what a run computed, and nothing the trainer may write freely.

    It covers the committed program, the initial state roots, and for every step in order
    its index, batch root and post-state roots. It leaves out timestamps, environment,
    configuration, probes, token and FLOP counts, check records and the experiment's name:
    a transcript re-written in any of those (or a deterministic rerun, which differs only
    in its timestamps) is the same committed run, and gets the same challenges
    (:func:`draw`). To change it, the trainer must change the computation it claims.
    """
    h = hashlib.sha256(RUN_CONTEXT)
    program = index.root.get("program")
    _absorb(h, program.get("digest") if isinstance(program, Mapping) else None)
    initial = index.root.get("initial")
    for tree in ("p", "o", "b"):
        _absorb(h, initial.get(tree) if isinstance(initial, Mapping) else None)
    for step in sorted(index.steps):
        record = index.steps[step]
        h.update(step.to_bytes(8, "little"))
        batch, post = record.get("batch"), record.get("post")
        _absorb(h, batch.get("root") if isinstance(batch, Mapping) else None)
        for tree in ("p", "o", "b"):
            _absorb(h, post.get(tree) if isinstance(post, Mapping) else None)
    return h.hexdigest()


def filing_target(target: float, filing: int) -> float:
    """The detection target of the ``filing``-th challenged proof of one experiment.

    Filing ``n`` may miss a run with the policy's forged fraction with probability at most
    ``(1 - target) / 2**n``. These sum to less than ``1 - target``, so by the union bound a
    forged run escapes *every* filing of its experiment together with at most the
    probability one filing was allowed before (docs/provers.md, "Challenges cannot be
    ground"). A target of 0 (no random challenges) stays 0.
    """
    if filing < 1:
        raise ValueError(f"filing {filing!r} must be 1 or more")
    if target <= 0.0:
        return 0.0
    return 1.0 - (1.0 - target) / 2.0**filing


def challenge_seed(key_hex: str, digest: str) -> bytes:
    """The seed of a committed run: HMAC-SHA256(organisation key, context || run digest).

    Unpredictable without the key, which never leaves the platform; the same for every
    transcript of the same run, so re-filing a run never buys a fresh draw.
    """
    import hmac

    return hmac.new(
        bytes.fromhex(key_hex), SEED_CONTEXT + bytes.fromhex(digest), hashlib.sha256
    ).digest()


def _organization_key(organization_id: int) -> str:
    """The organisation's challenge key, made on first use (under the row's lock)."""
    import secrets

    from attestations.accounts.models import Organization

    organization = Organization.objects.select_for_update().get(pk=organization_id)
    if not organization.challenge_key:
        organization.challenge_key = secrets.token_hex(32)
        organization.save(update_fields=["challenge_key"])
    return organization.challenge_key


def draw(proof: Proof, *, policy: ChallengePolicy | None = None) -> list[Challenge]:
    """Draw and store the challenges of a proof the offline verifier accepted.

    Called inside :func:`~attestations.proofs.ingest.ingest` (the ingest task). Idempotent: a proof that has
    its challenges keeps them. Grinding is closed three ways (docs/provers.md):

    * a transcript that already has a plan in this experiment is not drawn again: the
      newcomer is rejected as ``duplicate_transcript``, naming the proof it repeats;
    * the seed derives from the committed run (:func:`run_digest`, :func:`challenge_seed`)
      and the steps from the seed alone, so every transcript of the same run faces the
      same steps (a later filing draws more of the same stream, never fewer);
    * the ``n``-th challenged proof of the experiment is drawn for the target
      :func:`filing_target` gives, so all filings together keep the policy's bound.
    """
    from attestations.experiments.models import Experiment
    from provers.challenges import draw_challenges

    if proof.challenges_drawn is not None:
        return list(proof.challenges.all())
    policy = policy or ChallengePolicy.from_settings()
    index = TranscriptIndex.of(proof)
    report = proof.report or {}
    with transaction.atomic():
        # The experiment's row is the lock that numbers its filings; the organisation's
        # guards its key.
        Experiment.objects.select_for_update().filter(pk=proof.experiment_id).exists()
        key = _organization_key(proof.experiment.owner_id)
        siblings = Proof.objects.filter(experiment_id=proof.experiment_id).exclude(pk=proof.pk)
        earlier = (
            siblings.filter(
                challenges_drawn__isnull=False, transcript_digest=proof.transcript_digest
            )
            .order_by("pk")
            .first()
        )
        if earlier is not None:
            proof.record_verdict(
                ProofStatus.REJECTED,
                DUPLICATE_TRANSCRIPT,
                f"this transcript was filed before as proof {earlier.pk}, whose challenges "
                "stand; a transcript is challenged once per experiment",
                record=None,
                field="transcript",
            )
            return []
        filing = siblings.filter(challenges_drawn__isnull=False).count() + 1
        digest = run_digest(index)
        target = filing_target(policy.target, filing)
        plan = draw_challenges(
            steps=max(1, len(index.steps)),
            # Bound to the committed run, not to the transcript's bytes: see run_digest.
            transcript_digest=digest,
            self_checked=[int(s) for s in report.get("sampled") or []],
            seed=challenge_seed(key, digest),
            target=target,
            forged_fraction=policy.forged_fraction,
        )
        own, now = set(plan.self_checked), timezone.now()
        rows = []
        for step in plan.steps:
            origin = (
                ChallengeOrigin.GENESIS
                if step == plan.genesis
                else ChallengeOrigin.SELF_CHECKED
                if step in own
                else ChallengeOrigin.RANDOM
            )
            rows.append(
                Challenge(
                    proof=proof,
                    step=step,
                    origin=origin,
                    needed_files=index.files_for(step, None),
                    steps_total=index.steps_to_replay(step, None),
                    created=now,
                )
            )
        created = Challenge.objects.bulk_create(rows)
        proof.challenge_seed = plan.seed.hex()
        proof.challenge_seed_commitment = plan.commitment
        proof.challenge_target = plan.target
        proof.challenge_forged_fraction = plan.forged_fraction
        proof.challenge_filing = filing
        proof.challenge_run_digest = digest
        proof.challenges_drawn = now
        proof.challenge_deadline = now + policy.ttl
        proof.status = ProofStatus.CHALLENGED
        proof.save()
        Job.objects.create(
            kind="replay",
            organization_id=proof.experiment.owner_id,
            proof=proof,
            steps_total=sum(row.steps_total for row in rows),
        )
        AuditEvent.record(
            "proof.challenged",
            organization=proof.experiment.owner,
            target=proof,
            detail={
                "experiment": proof.experiment.full_name,
                "challenges": len(rows),
                "steps": list(plan.steps),
                "seed_commitment": plan.commitment,
                "target": plan.target,
                "forged_fraction": plan.forged_fraction,
                "filing": filing,
                "run_digest": digest,
                "deadline": proof.challenge_deadline.isoformat(),
            },
        )
        # Files attached before the draw (an "upload everything" client) answer at once.
        mark_ready(proof)
    return created


# --- Answering ----------------------------------------------------------------------------


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
    if kind not in (ArtifactKind.SNAPSHOT, ArtifactKind.BATCH, ArtifactKind.ARTIFACT):
        raise ArtifactRejectedError(
            f"files[{position}].kind: {kind!r} cannot be attached; expected one of "
            "artifact, snapshot, batch (the transcript is the proof itself)",
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
    if model_names(name):
        return True  # the final model (dvbench's proof.save_model), bound by the certificate
    return "/" not in name and (name == PROBES or name.startswith("program."))


def _commitment_check(
    index: TranscriptIndex, name: str, data: bytes
) -> tuple[str, str, dict[str, Any]] | None:
    """Check a file against what the transcript commits for it.

    Returns:
        None when it matches (or the transcript commits nothing for it), else
        ``(code, message, detail)``.
    """
    from zkdv.batch import commit_batch
    from zkdv.config import ZKDVConfig
    from zkdv.hashing import Domain, hash_bytes
    from zkdv.merkle import LeafSpec, commit_state

    base = name.rsplit("/", 1)[-1]
    if name == index.program_file:
        program = index.root.get("program") or {}
        if hash_bytes(Domain.FILE, data) != program.get("digest"):
            return (
                "program_mismatch",
                f"{name} ({len(data)} bytes) does not hash to the program digest the "
                "transcript's root record commits",
                {"file": name},
            )
        return None
    if base.startswith("snapshot-"):
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
        leaves, offset = [], 0
        raw = np.frombuffer(data, dtype=np.uint8)
        for spec in specs:
            dtype = np.dtype(spec.dtype).newbyteorder("<")
            leaves.append(
                (spec.path, raw[offset : offset + spec.nbytes].view(dtype).reshape(spec.shape))
            )
            offset += spec.nbytes
        key = {"params": "p", "opt_state": "o", "buffers": "b"}[tree]
        if commit_state(leaves, chunk).root != snap["roots"][key]:
            return (
                "snapshot_mismatch",
                f"{name} does not hash to the {tree} root the transcript commits for step {step}",
                {"file": name, "step": step},
            )
        return None
    if base.startswith("batch-"):
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
        import struct

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
    blobs = _owned_blobs(proof, claims)
    existing = {a.name: a for a in proof.artifacts.all()}
    needed = _needed(proof)
    index: TranscriptIndex | None = None
    fresh: list[ProofArtifact] = []
    for position, claim in enumerate(claims):
        blob = blobs[claim.sha256]
        if blob.size != claim.size:
            raise ArtifactRejectedError(
                f"files[{position}].size: {claim.name} declares {claim.size} bytes; the stored "
                f"blob sha256:{claim.sha256} has {blob.size}",
                code="size_mismatch",
                field=f"files[{position}].size",
                detail={"expected": blob.size, "got": claim.size},
            )
        known = existing.get(claim.name)
        if known is not None:
            if known.sha256 != claim.sha256:
                raise ArtifactConflictError(
                    f"files[{position}]: {claim.name} is already attached to proof {proof.pk} "
                    f"with sha256 {known.sha256}; a proof's files never change",
                    code="artifact_conflict",
                    field=f"files[{position}].sha256",
                    detail={"attached": known.sha256, "got": claim.sha256},
                )
            continue
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
            if index is None:
                index = TranscriptIndex.of(proof)
            with default_storage.open(blob.storage_name, "rb") as handle:
                problem = _commitment_check(index, claim.name, handle.read())
            if problem is not None:
                code, message, detail = problem
                raise ArtifactMismatchError(
                    f"files[{position}]: {message}",
                    code=code,
                    field=f"files[{position}].sha256",
                    detail=detail,
                )
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


def _owned_blobs(proof: Proof, claims: Sequence[FileClaim]) -> dict[str, Blob]:
    """The blobs named by digest, each completed by an upload of this organisation."""
    digests = {claim.sha256 for claim in claims}
    owned = {
        blob.sha256: blob
        for blob in Blob.objects.filter(
            sha256__in=digests,
            uploads__status=UploadStatus.COMPLETE,
            uploads__organization_id=proof.experiment.owner_id,
        ).distinct()
    }
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


def enqueue(challenge_ids: Iterable[int]) -> None:
    from attestations.challenges.tasks import replay_challenge

    for challenge_id in challenge_ids:
        result = replay_challenge.apply_async((challenge_id,), queue="replay")
        Challenge.objects.filter(pk=challenge_id).update(task_id=str(result.id))


# --- Replaying ----------------------------------------------------------------------------


def claim(challenge_id: int) -> bool:
    """Take a ready challenge (or one whose replaying worker died) for this worker.

    A conditional update (:func:`~attestations.core.db.take_claim`): of two deliveries of
    the same message, one wins. Each claim counts an attempt.
    """
    return take_claim(
        Challenge.objects.filter(pk=challenge_id),
        waiting=ChallengeStatus.READY,
        working=ChallengeStatus.REPLAYING,
        attempts=F("attempts") + 1,
    )


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
_TRANSITIONS: OrderedDict[str, Any] = OrderedDict()
_TRANSITIONS_KEPT = 2
_TRANSITIONS_LOCK = threading.Lock()


def _transition(proof: Proof, directory: Path) -> Any | None:
    import importlib

    from provers import PROVERS, root_record
    from provers.replay import ReplayError

    key = proof.transcript.sha256
    with _TRANSITIONS_LOCK:
        if key in _TRANSITIONS:
            _TRANSITIONS.move_to_end(key)
            return _TRANSITIONS[key]
    try:
        name = PROVERS.get(str(root_record(directory).get("prover")))
        if name is None:
            return None
        transition = importlib.import_module(name).load_transition(directory)
    except ReplayError:
        return None  # verify_challenge loads it again and reports why it cannot
    with _TRANSITIONS_LOCK:
        _TRANSITIONS[key] = transition
        while len(_TRANSITIONS) > _TRANSITIONS_KEPT:
            _TRANSITIONS.popitem(last=False)
    return transition


#: Probe files already checked against their transcript, by ``(transcript, probes)``
#: SHA-256: the first replay of a proof checks the whole file, later ones reuse that.
_PROBES_CHECKED: OrderedDict[tuple[str, str], dict[str, Any] | None] = OrderedDict()
_PROBES_KEPT = 16


def check_probes(proof: Proof, directory: Path) -> dict[str, Any] | None:
    """Check the attached ``probes.bin`` against every probe digest of the transcript.

    The trainer attaches the probe file after ingest, so the offline verifier could not
    check it then; the first replay does, before trusting any probe it compares. Runs
    the offline verifier over the proof directory (records and probes side by side).

    Returns:
        None when there is no probe file or it matches; else a failed verdict's dict
        naming the verifier's reason (``probe_digest``, ``probe_missing``, ...), the
        record and the field.
    """
    from zkdv.verify import verify_transcript

    path = directory / PROBES
    artifact = proof.artifacts.filter(name=PROBES).select_related("blob").first()
    if artifact is None or not path.exists():
        return None
    key = (proof.transcript.sha256, artifact.sha256)
    with _TRANSITIONS_LOCK:
        if key in _PROBES_CHECKED:
            return _PROBES_CHECKED[key]
    report = verify_transcript(directory)
    failure: dict[str, Any] | None = None
    if not report.ok:
        failure = {
            "ok": False,
            "step": None,
            "reason": report.reason or "probe_mismatch",
            "message": f"{PROBES}: {report.message}",
            "record": report.record,
            "field": report.field,
            "evidence": [],
        }
    with _TRANSITIONS_LOCK:
        _PROBES_CHECKED[key] = failure
        while len(_PROBES_CHECKED) > _PROBES_KEPT:
            _PROBES_CHECKED.popitem(last=False)
    return failure


def replay_one(challenge: Challenge) -> dict[str, Any]:
    """Materialise and replay one claimed challenge; returns the verdict's dict."""
    import provers

    proof = challenge.proof
    directory = proof_directory(proof, challenge.needed_files)
    failure = check_probes(proof, directory)
    if failure is not None:
        return {**failure, "step": challenge.step}
    transition = _transition(proof, directory)
    verdict = provers.verify_challenge(
        directory, challenge.step, through=challenge.through, transition=transition
    )
    return verdict.to_dict()


def record_verdict(challenge: Challenge, verdict: Mapping[str, Any]) -> bool:
    """Store a replay verdict; False if the challenge was no longer ours to finish."""
    evidence = list(verdict.get("evidence") or [])
    replayed = sum(1 for e in evidence if e.get("ok"))
    ok = bool(verdict.get("ok"))
    with transaction.atomic():
        done = Challenge.objects.filter(pk=challenge.pk, status=ChallengeStatus.REPLAYING).update(
            status=ChallengeStatus.PASSED if ok else ChallengeStatus.FAILED,
            reason="" if ok else str(verdict.get("reason") or "replay_failed")[:64],
            message="" if ok else str(verdict.get("message") or ""),
            evidence=dict(verdict),
            steps_replayed=len(evidence) if ok else replayed,
            finished=timezone.now(),
        )
        if not done:
            return False
        AuditEvent.record(
            f"challenge.{'passed' if ok else 'failed'}",
            organization=challenge.proof.experiment.owner,
            target=challenge,
            detail={
                "proof": challenge.proof_id,
                "step": challenge.step,
                "through": challenge.through,
                "reason": None if ok else verdict.get("reason"),
                "attempts": challenge.attempts,
            },
        )
        _progress(challenge.proof_id)
        settle(challenge.proof_id)
    return True


def record_error(challenge_id: int, reason: str, message: str) -> None:
    """A permanent failure that is not the proof's fault (the replay itself broke)."""
    with transaction.atomic():
        done = Challenge.objects.filter(
            pk=challenge_id, status__in=[ChallengeStatus.REPLAYING, ChallengeStatus.READY]
        ).update(
            status=ChallengeStatus.ERROR,
            reason=reason[:64],
            message=message,
            finished=timezone.now(),
        )
        if done:
            proof_id = Challenge.objects.values_list("proof_id", flat=True).get(pk=challenge_id)
            _progress(proof_id)
            settle(proof_id)


def release_claim(challenge_id: int) -> None:
    """Give a claimed challenge back (a transient failure: the retry claims it again)."""
    Challenge.objects.filter(pk=challenge_id, status=ChallengeStatus.REPLAYING).update(
        status=ChallengeStatus.READY
    )


def _progress(proof_id: int) -> None:
    job = Job.objects.filter(proof_id=proof_id, kind="replay").order_by("-created").first()
    if job is None:
        return
    rows = list(Challenge.objects.filter(proof_id=proof_id).values("status", "steps_total"))
    done = sum(r["steps_total"] for r in rows if r["status"] in CHALLENGE_FINAL)
    total = sum(r["steps_total"] for r in rows) or 1
    fields: dict[str, Any] = {"steps_done": done, "progress": min(1.0, done / total)}
    if job.status == JobStatus.QUEUED:
        fields.update(status=JobStatus.RUNNING, started=timezone.now())
    Job.objects.filter(pk=job.pk).update(**fields)


# --- Verdicts -----------------------------------------------------------------------------


def settle(proof_id: int) -> str | None:
    """Give the proof its verdict once every challenge is final; None while some are not.

    ``valid`` iff every challenge passed; otherwise ``rejected`` with the first failing
    challenge's reason (by step). Reveals the seed; recording the verdict queues the certificate
    (``verdict_recorded``). Runs
    inside the caller's transaction and locks the proof row, so two workers finishing
    the last two challenges settle it once.
    """
    proof = (
        Proof.objects.select_for_update()
        .select_related("experiment__owner", "transcript")
        .get(pk=proof_id)
    )
    if proof.status != ProofStatus.CHALLENGED:
        return None
    challenges = list(proof.challenges.order_by("step", "through"))
    if any(c.status not in CHALLENGE_FINAL for c in challenges):
        return None
    failed = next((c for c in challenges if c.status != ChallengeStatus.PASSED), None)
    now = timezone.now()
    proof.challenge_seed_revealed = now
    if failed is None:
        proof.record_verdict(ProofStatus.VALID, "", "")
    else:
        reason = failed.reason or failed.status
        proof.record_verdict(
            ProofStatus.REJECTED,
            reason,
            f"challenge of step {failed.step}: {failed.message or failed.get_status_display()}",
            field=f"challenges.step[{failed.step}]",
        )
    job = Job.objects.filter(proof_id=proof.pk, kind="replay").order_by("-created").first()
    if job is not None:
        job.finish(
            JobStatus.SUCCEEDED if failed is None or failed.status != "error" else JobStatus.FAILED,
            proof.reason,
        )
    transaction.on_commit(lambda: release_directory(proof))
    return proof.status


def requeue_lost(now: Any = None) -> int:
    """Queue again challenges whose message was lost (a broker flushed, a worker died).

    A ``ready`` challenge not claimed, or a ``replaying`` claim not finished, within
    twice the task time limit has no live message behind it; a second message is
    harmless, since only one delivery can claim the challenge.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=2 * replay_time_limit())
    lost = list(
        Challenge.objects.filter(
            Q(status=ChallengeStatus.READY, answered__lt=cutoff)
            | Q(status=ChallengeStatus.REPLAYING, claimed__lt=cutoff)
        ).values_list("pk", flat=True)
    )
    if lost:
        enqueue(lost)
    return len(lost)


def expire(now: Any = None) -> int:
    """Expire the challenges of proofs past their deadline; returns how many expired.

    Also re-queues challenges whose replay message was lost (:func:`requeue_lost`).
    """
    now = now or timezone.now()
    requeue_lost(now)
    count = 0
    overdue = Proof.objects.filter(status=ProofStatus.CHALLENGED, challenge_deadline__lt=now)
    for proof_id in overdue.values_list("pk", flat=True):
        count += expire_proof(proof_id, now)
    return count


def expire_proof(proof_id: int, now: Any = None) -> int:
    """Expire one proof's unanswered challenges if its deadline passed (check on read)."""
    now = now or timezone.now()
    with transaction.atomic():
        expired = Challenge.objects.filter(
            proof_id=proof_id,
            proof__challenge_deadline__lt=now,
            proof__status=ProofStatus.CHALLENGED,
            status=ChallengeStatus.PENDING,
        ).update(
            status=ChallengeStatus.EXPIRED,
            reason="challenge_expired",
            message="the files this challenge needs were not provided before the deadline",
            finished=now,
        )
        if expired:
            _progress(proof_id)
            settle(proof_id)
    return expired


def expire_if_due(proof: Proof) -> bool:
    """The check on read: a proof shown after its deadline shows its expired verdict.

    Returns:
        Whether anything expired (the caller re-reads the proof).
    """
    if (
        proof.status == ProofStatus.CHALLENGED
        and proof.challenge_deadline is not None
        and proof.challenge_deadline < timezone.now()
    ):
        return expire_proof(proof.pk) > 0
    return False
