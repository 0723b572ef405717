"""Ingest: run the offline verifier on a filed transcript and record where the proof stands.

The ingest task (:func:`attestations.proofs.tasks.ingest_proof`) claims a proof
(:meth:`Proof.claim <attestations.proofs.models.Proof.claim>`) and calls :func:`ingest`.
Bad transcript data is a verdict (``rejected`` with the verifier's reason), never an
exception; an unusable verifier is recorded as ``error``.

A transcript the verifier accepts is then the platform's to challenge. Challenges sit
above proofs, so this module does not import them: the challenges app registers how a
transcript is challenged (:class:`Challenger`) in its ``ready()``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction

from attestations.proofs.models import (
    NO_PROGRAM,
    PROBES_ARTIFACT,
    IngestProgress,
    JobStatus,
    Proof,
    ProofStatus,
)

log = logging.getLogger(__name__)

__all__ = ["Challenger", "ingest", "register_challenger"]


class Challenger(Protocol):
    """How a transcript the verifier accepted is challenged (``attestations.challenges``)."""

    def replayable(self, root: Mapping[str, Any] | None) -> bool:
        """Whether the transcript commits a program a replay prover can run."""
        ...

    def draw(self, proof: Proof) -> Any:
        """Draw and store the proof's challenges (or reject a duplicate transcript)."""
        ...


_challenger: Challenger | None = None


def register_challenger(challenger: Challenger) -> None:
    """Set how accepted transcripts are challenged; called by ``ChallengesConfig.ready``."""
    global _challenger
    _challenger = challenger


def _challenges() -> Challenger:
    if _challenger is None:
        raise RuntimeError("no challenger registered: is attestations.challenges installed?")
    return _challenger


def ingest(proof: Proof) -> None:
    """Run the offline verifier on the stored transcript and record the verdict.

    Called by the ingest task after :meth:`Proof.claim`.
    """
    job = proof.jobs.order_by("-created").first()
    if job is not None:
        job.start()
    try:
        from zkdv.verify import verify_transcript
    except ImportError as error:
        with transaction.atomic():
            proof.record_verdict(ProofStatus.ERROR, "verifier_unavailable", f"{error}")
            if job is not None:
                job.finish(JobStatus.FAILED, "verifier_unavailable")
        return

    progress = IngestProgress(job, proof.transcript.size)
    try:
        with (
            default_storage.open(proof.transcript.storage_name, "rb") as handle,
            _probes_file(proof) as probes,
        ):
            report = verify_transcript(handle, probes_path=probes, on_progress=progress)
    except Exception as error:
        # Not the transcript's fault (the verifier never raises for bad data): record it
        # where users see it rather than leave the proof "verifying" for ever.
        log.exception("verifying proof %s failed", proof.pk)
        with transaction.atomic():
            proof.record_verdict(
                ProofStatus.ERROR, "verifier_failed", f"{type(error).__name__}: {error}"
            )
            if job is not None:
                job.finish(JobStatus.FAILED, "verifier_failed")
        return
    # The verdict, its audit event, the challenges and the job's end are one transaction:
    # a database lost between them (a restart mid-ingest) must not leave a final proof
    # whose job runs for ever, or a verdict without its audit event; the task's retry
    # then finds the proof to verify again. A final verdict queues its certificate on
    # commit (``verdict_recorded``); a duplicate is certified by the proof it repeats.
    with transaction.atomic():
        proof.report = report.to_dict()
        proof.steps = report.steps
        proof.checks = report.checks
        proof.transcript_digest = report.digest or ""
        root = report.root if isinstance(report.root, Mapping) else None
        proof.prover = str(root.get("prover", "")) if root else ""
        if not report.ok:
            proof.record_verdict(
                ProofStatus.REJECTED,
                report.reason or "rejected",
                report.message or "",
                record=report.record,
                field=report.field or "",
            )
        elif (mismatch := proof.experiment.check_identity(root)) is not None:
            proof.record_verdict(
                ProofStatus.REJECTED, mismatch[0], mismatch[1], record=0, field=mismatch[2]
            )
        else:
            named = root["experiment"]  # type: ignore[index]
            proof.spec = proof.experiment.specs.get(digest=named["spec_digest"])
            challenges = _challenges()
            if challenges.replayable(root):
                # The transcript is consistent; now the platform stops trusting the
                # trainer: its challenges decide the verdict (attestations/challenges/).
                challenges.draw(proof)
            elif settings.DVBENCH.get("REQUIRE_PROGRAM", True):
                # Without a program no step can be replayed, so accepting it would let a
                # forger escape every challenge just by leaving the program out.
                proof.record_verdict(
                    ProofStatus.REJECTED, *NO_PROGRAM, record=0, field="root.program"
                )
            else:
                # Opted out (DVBENCH_REQUIRE_PROGRAM=false): the offline verdict stands.
                proof.record_verdict(ProofStatus.VALID, "", "")
        if job is not None:
            job.finish(JobStatus.SUCCEEDED, proof.reason)


@contextmanager
def _probes_file(proof: Proof) -> Iterator[str | None]:
    """A local copy of the attached ``probes.bin``, if any, for the verifier to check.

    The SDK attaches it after filing the transcript, so at a first ingest it is usually
    absent and the first replay checks it (``replay.check_probes``); when it is here (a
    re-ingest), every probe is checked against the transcript's digests.
    """
    artifact = proof.artifacts.filter(name=PROBES_ARTIFACT).select_related("blob").first()
    if artifact is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="dvbench-probes-") as scratch:
        path = f"{scratch}/{PROBES_ARTIFACT}"
        with (
            default_storage.open(artifact.blob.storage_name, "rb") as source,
            open(path, "wb") as target,
        ):
            shutil.copyfileobj(source, target, 1024 * 1024)
        yield path
