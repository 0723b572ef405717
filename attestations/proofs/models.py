"""Proofs: transcripts filed against an experiment, the files attached to them, and jobs.

A proof's state changes are methods here (:meth:`Proof.claim`, :meth:`Proof.record_verdict`);
what orchestrates them (running the verifier, drawing challenges) is the ingest service,
:mod:`attestations.proofs.ingest`. Recording a final verdict sends
:data:`attestations.proofs.signals.verdict_recorded`.
"""

from __future__ import annotations

import logging
import time
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from attestations.accounts.models import Organization
from attestations.audit.models import AuditEvent
from attestations.core.db import take_claim
from attestations.core.validators import sha256_validator
from attestations.experiments.models import Experiment, ExperimentSpec
from attestations.proofs.signals import verdict_recorded
from attestations.uploads.models import ArtifactKind, Blob, Upload

log = logging.getLogger(__name__)


class ProofStatus(models.TextChoices):
    """Where a proof stands.

    ``pending`` and ``verifying`` cover ingest (the offline verifier); a transcript that
    passes it is ``challenged`` while the platform's challenges wait for answers and
    replays. ``valid``, ``rejected`` and ``error`` are final.
    """

    PENDING = "pending", "Pending"
    VERIFYING = "verifying", "Verifying"
    CHALLENGED = "challenged", "Challenged"
    VALID = "valid", "Valid"
    REJECTED = "rejected", "Rejected"
    ERROR = "error", "Verifier error"


#: The verdict on a transcript that commits no program while one is required.
NO_PROGRAM: tuple[str, str] = (
    "no_program",
    "the transcript commits no program artifact, so the platform cannot replay any step; "
    "record the run with zkdv.jax or zkdv.torch",
)


#: The reason of a proof whose transcript already has a challenge plan in its experiment.
DUPLICATE_TRANSCRIPT = "duplicate_transcript"

#: The name of the probe file among a proof's artifacts (``zkdv.records.PROBES_FILE``).
PROBES_ARTIFACT = "probes.bin"

#: The fewest seconds between two progress writes of an ingest job: a few a second.
INGEST_PROGRESS_INTERVAL = 0.25


class IngestProgress:
    """Record how far the verifier got (bytes of the transcript verified) on a job.

    Called by ``zkdv.verify.verify_transcript`` every few hundred records; writes at
    most one row update per ``INGEST_PROGRESS_INTERVAL`` seconds, only forward, and
    stops short of 1.0, which :meth:`Job.finish` writes with the verdict.
    """

    def __init__(self, job: Job | None, total: int) -> None:
        self.job_id = job.pk if job is not None else None
        self.total = total
        self.interval = INGEST_PROGRESS_INTERVAL
        self.fraction = 0.0
        self.written = float("-inf")

    def __call__(self, done: int) -> None:
        if self.job_id is None or self.total <= 0:
            return
        now = time.monotonic()
        fraction = min(0.99, done / self.total)
        if fraction <= self.fraction or now - self.written < self.interval:
            return
        self.fraction, self.written = fraction, now
        Job.objects.filter(pk=self.job_id, status=JobStatus.RUNNING).update(progress=fraction)


class Proof(models.Model):
    """A transcript filed against an experiment, and the verifier's verdict on it."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="proofs")
    spec = models.ForeignKey(ExperimentSpec, on_delete=models.PROTECT, related_name="proofs")
    transcript = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="proofs")
    upload = models.OneToOneField(
        Upload, on_delete=models.SET_NULL, null=True, blank=True, related_name="proof"
    )
    status = models.CharField(
        max_length=16, choices=ProofStatus.choices, default=ProofStatus.PENDING, db_index=True
    )
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    record_index = models.IntegerField(null=True, blank=True)
    field = models.CharField(max_length=200, blank=True)
    steps = models.PositiveIntegerField(default=0)
    checks = models.PositiveIntegerField(default=0)
    prover = models.CharField(max_length=32, blank=True)
    transcript_digest = models.CharField(max_length=128, blank=True)
    report = models.JSONField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    claimed = models.DateTimeField(null=True, blank=True)
    verified = models.DateTimeField(null=True, blank=True)
    # The challenge plan (attestations/challenges/draw.py). The seed is the platform's secret
    # until the verdict is final: only its SHA-256 is shown while answers are pending,
    # so the trainer cannot predict which steps a re-filed transcript would face.
    challenge_seed = models.CharField(max_length=64, blank=True)
    challenge_seed_commitment = models.CharField(max_length=64, blank=True)
    challenge_seed_revealed = models.DateTimeField(null=True, blank=True)
    challenge_target = models.FloatField(null=True, blank=True)
    challenge_forged_fraction = models.FloatField(null=True, blank=True)
    challenges_drawn = models.DateTimeField(null=True, blank=True)
    challenge_deadline = models.DateTimeField(null=True, blank=True)
    #: This proof's place among the experiment's proofs that were challenged (1, 2, ...):
    #: each later one is drawn against half the miss probability (docs/provers.md).
    challenge_filing = models.PositiveIntegerField(null=True, blank=True)
    #: SHA-256 over what the run computed (program, initial state, every step's batch and
    #: post-state roots): the same committed run always gets the same seed.
    challenge_run_digest = models.CharField(max_length=64, blank=True)

    class Meta:
        db_table = "attestations_proof"
        ordering = ["-created"]
        constraints = [
            # One challenge plan per transcript per experiment: filing the same transcript
            # again never draws again. (Plans drawn before filings were numbered carry no
            # index and are left as they are: a database may hold the duplicates that
            # this rule was written against, and they stay on the record.)
            models.UniqueConstraint(
                fields=["experiment", "transcript_digest"],
                condition=Q(challenge_filing__isnull=False),
                name="one_plan_per_transcript",
            ),
            models.UniqueConstraint(
                fields=["experiment", "challenge_filing"],
                condition=Q(challenge_filing__isnull=False),
                name="one_proof_per_filing_index",
            ),
        ]

    def __str__(self) -> str:
        return f"proof {self.pk} of {self.experiment_id} ({self.status})"

    @property
    def verdict_label(self) -> str:
        """The verdict as auditors read it: an unanswered challenge is an abandoned proof."""
        if self.status == ProofStatus.REJECTED and self.reason == "challenge_expired":
            return "abandoned"
        return str(self.status)

    @property
    def revealed_seed(self) -> str | None:
        """The challenge seed once it may be shown (the verdict is final), else None."""
        return self.challenge_seed if self.challenge_seed_revealed is not None else None

    @property
    def organization_id(self) -> int:
        return self.experiment.owner_id

    @property
    def is_final(self) -> bool:
        return self.status in {ProofStatus.VALID, ProofStatus.REJECTED, ProofStatus.ERROR}

    @property
    def is_duplicate(self) -> bool:
        """Rejected because the same transcript already has a plan in this experiment."""
        return self.status == ProofStatus.REJECTED and self.reason == DUPLICATE_TRANSCRIPT

    @classmethod
    def claim(cls, proof_id: int) -> bool:
        """Move a pending proof to ``verifying``; False if another worker owns it.

        A proof stuck in ``verifying`` longer than the task hard limit belonged to a
        worker that died, and may be claimed again.
        """
        return take_claim(
            cls.objects.filter(pk=proof_id),
            waiting=ProofStatus.PENDING,
            working=ProofStatus.VERIFYING,
        )

    @property
    def is_certifiable(self) -> bool:
        """A final verdict the platform signs: valid or rejected, and not a duplicate.

        A duplicate is certified by the proof it repeats; an ``error`` is no verdict on the
        run, so there is nothing to certify.
        """
        return self.status in {ProofStatus.VALID, ProofStatus.REJECTED} and not self.is_duplicate

    def record_verdict(
        self, status: str, reason: str, message: str, *, record: int | None = None, field: str = ""
    ) -> None:
        """Record where the proof stands (with why), and its audit event.

        Called inside the caller's transaction. A verdict the platform certifies
        (:attr:`is_certifiable`) sends :data:`~attestations.proofs.signals.verdict_recorded`.
        """
        self.status = status
        self.reason = reason[:64]
        self.message = message
        self.record_index = record
        self.field = field[:200]
        self.verified = timezone.now()
        self.save()
        AuditEvent.record(
            f"proof.{status}",
            organization=self.experiment.owner,
            target=self,
            detail={
                "experiment": self.experiment.full_name,
                "reason": reason or None,
                "record": record,
                "steps": self.steps,
                "checks": self.checks,
            },
        )
        if self.is_certifiable:
            verdict_recorded.send(sender=Proof, proof=self)


class ProofArtifact(models.Model):
    """A file of a proof directory the trainer attached: a stored blob under its name.

    ``name`` is the path relative to the proof directory (``snapshots/00000004/p.bin``),
    the same on the trainer's disk and in the directory a replay worker materialises.
    """

    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=255)
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="artifacts")
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    size = models.PositiveBigIntegerField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_proofartifact"
        constraints = [
            models.UniqueConstraint(fields=["proof", "name"], name="proof_artifact_name_unique")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} of proof {self.proof_id}"


class JobStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class Job(models.Model):
    """A background task as users see it: what it is for, how far it got, how it ended."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=32)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, null=True, related_name="jobs")
    status = models.CharField(
        max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True
    )
    progress = models.FloatField(default=0.0)
    # Replay jobs count steps: ``progress`` is ``steps_done / steps_total``.
    steps_done = models.PositiveIntegerField(default=0)
    steps_total = models.PositiveIntegerField(default=0)
    reason = models.CharField(max_length=64, blank=True)
    task_id = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "attestations_job"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.kind} job {self.id} ({self.status})"

    def start(self) -> None:
        Job.objects.filter(pk=self.pk).update(
            status=JobStatus.RUNNING, started=timezone.now(), progress=0.0
        )

    def finish(self, status: str, reason: str = "") -> None:
        self.status, self.reason, self.progress = status, reason[:64], 1.0
        self.finished = timezone.now()
        self.save(update_fields=["status", "reason", "progress", "finished"])
