"""Filing a transcript: an upload of kind ``transcript`` becomes a proof to verify.

The uploads app moves bytes; this module is what a transcript upload means, registered
for the kind by :class:`~attestations.proofs.apps.ProofsConfig` (``KindRules``):

* opening or completing one is refused once the experiment holds as many proofs as
  allowed (:func:`check_proof_room`), unless it is a transcript filed before;
* the assembled file's root record must name the experiment and one of its spec
  versions, or the upload fails with 422 before anything is stored;
* completing it files the proof (:func:`file_proof`) and queues its ingest on commit;
  the same bytes filed again name the earlier proof instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.experiments.models import Experiment
from attestations.proofs.errors import TooManyProofsError, TranscriptRejectedError
from attestations.proofs.models import Job, Proof, ProofStatus
from attestations.uploads.kinds import KindRules
from attestations.uploads.models import Upload


class TranscriptFiling(KindRules):
    """The rules of transcript uploads (``ArtifactKind.TRANSCRIPT``)."""

    def before_open(self, experiment: Experiment, sha256: str) -> None:
        # Said before the lab sends gigabytes, and again at completion.
        if not _filed(experiment, sha256):
            check_proof_room(experiment)

    def before_complete(self, upload: Upload) -> None:
        if not _filed(upload.experiment, upload.sha256):
            check_proof_room(upload.experiment)

    def check_file(self, upload: Upload, path: Path) -> None:
        check_transcript_identity(upload, path)

    def completed(self, upload: Upload, *, user: User, ip: str | None) -> None:
        file_proof(upload, user=user, ip=ip)


def check_transcript_identity(upload: Upload, path: Path) -> None:
    """Reject, before anything is stored, a transcript whose root names another experiment.

    The full verification runs later in the ingest task; this reads only the root record,
    so a transcript filed under the wrong experiment is a 422 at completion.
    """
    root = read_transcript_root(path)
    if root is None:
        return  # unreadable here; the verifier will say precisely why
    mismatch = upload.experiment.check_identity(root)
    if mismatch is not None:
        reason, message, field = mismatch
        raise TranscriptRejectedError(message, code=reason, field=field, detail={"record": 0})


#: How much of a transcript is read to find its root record: the root is the first record
#: and, even with the schema of a very large model, far smaller than this.
ROOT_PREFIX_BYTES = 16 * 1024 * 1024


def read_transcript_root(path: Path) -> dict[str, Any] | None:
    """The decoded root record of a transcript file, or None if it cannot be decoded.

    Only a prefix of the file is read; a transcript whose first record cannot be decoded
    is left for the verifier, which names the problem with its record index.
    """
    from zkdv.records import iter_records

    with open(path, "rb") as handle:
        prefix = handle.read(ROOT_PREFIX_BYTES)
    try:
        first = next(iter_records(prefix), None)
    except Exception:  # noqa: BLE001 - bad data is the verifier's to report, with a reason
        return None
    return first.data if first is not None and isinstance(first.data, dict) else None


def _filed(experiment: Experiment, sha256: str) -> bool:
    """Whether a transcript with this SHA-256 is filed for the experiment (errors aside)."""
    return (
        experiment.proofs.filter(transcript__sha256=sha256)
        .exclude(status=ProofStatus.ERROR)
        .exists()
    )


def check_proof_room(experiment: Experiment) -> None:
    """Refuse a transcript for an experiment that holds as many proofs as allowed.

    Verifier errors (the platform's fault, not a filing the lab chose) do not count.

    Raises:
        TooManyProofsError: 409 ``too_many_proofs``.
    """
    limit = dvbench_int("MAX_PROOFS_PER_EXPERIMENT")
    filed = experiment.proofs.exclude(status=ProofStatus.ERROR).count()
    if filed >= limit:
        raise TooManyProofsError(
            f"{experiment.full_name} already holds {filed} proofs, the most one experiment "
            f"may hold (DVBENCH_MAX_PROOFS_PER_EXPERIMENT={limit}); every one stays on its "
            "record. Register a new experiment for a new run.",
            field="experiment",
            detail={"limit": limit, "filed": filed},
        )


def file_proof(upload: Upload, *, user: User | None, ip: str | None = None) -> Proof:
    """Create the proof for a completed transcript upload and queue its ingest.

    A transcript already filed for the experiment (the same bytes) is not filed again:
    the upload records the proof it duplicates, and that proof is returned, its
    challenges unchanged. A proof the platform failed to verify (``error``) is filed anew.

    Raises:
        TooManyProofsError: the experiment holds as many proofs as allowed.
    """
    from attestations.proofs.tasks import ingest_proof

    experiment = upload.experiment
    assert upload.blob is not None and experiment.current_spec is not None
    # Filings of one experiment are counted and compared one at a time.
    Experiment.objects.select_for_update().filter(pk=experiment.pk).exists()
    existing = (
        experiment.proofs.filter(transcript=upload.blob)
        .exclude(status=ProofStatus.ERROR)
        .order_by("pk")
        .first()
    )
    if existing is not None:
        upload.duplicate_of = existing
        upload.save(update_fields=["duplicate_of"])
        AuditEvent.record(
            "proof.refiled",
            actor=user,
            organization=experiment.owner,
            target=existing,
            detail={
                "experiment": experiment.full_name,
                "transcript": upload.blob.sha256,
                "upload": str(upload.pk),
            },
            ip=ip,
        )
        return existing
    check_proof_room(experiment)
    proof = Proof.objects.create(
        experiment=experiment,
        spec=experiment.current_spec,
        transcript=upload.blob,
        upload=upload,
        created_by=user,
    )
    job = Job.objects.create(kind="ingest", organization=experiment.owner, proof=proof)
    AuditEvent.record(
        "proof.filed",
        actor=user,
        organization=experiment.owner,
        target=proof,
        detail={"experiment": experiment.full_name, "transcript": upload.blob.sha256},
        ip=ip,
    )

    def enqueue() -> None:
        result = ingest_proof.delay(proof.pk)
        Job.objects.filter(pk=job.pk).update(task_id=str(result.id))

    transaction.on_commit(enqueue)
    return proof
