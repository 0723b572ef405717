"""Models of the attestations app.

Behaviour lives here (fat models, thin views): access rules on :class:`Membership`,
key issuing and checking on :class:`ApiKey`, spec canonicalisation and versioning on
:class:`Experiment` / :class:`ExperimentSpec`, and the verdict of a transcript on
:class:`Proof`. Logic that moves bytes through storage across several models lives in
``attestations/uploads.py``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from attestations.accounts.models import Organization
from attestations.audit.models import AuditEvent
from attestations.core.validators import sha256_validator
from attestations.experiments.models import Experiment, ExperimentSpec
from attestations.uploads.models import ArtifactKind, Blob, Upload

log = logging.getLogger(__name__)

# --- Proofs and jobs --------------------------------------------------------------------


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
    # The challenge plan (attestations/replay.py). The seed is the platform's secret
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
        now = timezone.now()
        stale = now - timedelta(seconds=int(getattr(settings, "CELERY_TASK_TIME_LIMIT", 3600)))
        return bool(
            cls.objects.filter(pk=proof_id)
            .filter(
                Q(status=ProofStatus.PENDING) | Q(status=ProofStatus.VERIFYING, claimed__lt=stale)
            )
            .update(status=ProofStatus.VERIFYING, claimed=now)
        )

    def verify(self) -> None:
        """Run the offline verifier on the stored transcript and record the verdict.

        Called by the ingest task after :meth:`claim`. Bad transcript data is a verdict
        (``rejected`` with the verifier's reason), never an exception; an unusable
        verifier is recorded as ``error``.
        """
        job = self.jobs.order_by("-created").first()
        if job is not None:
            job.start()
        try:
            from zkdv.verify import verify_transcript
        except ImportError as error:
            with transaction.atomic():
                self._record(ProofStatus.ERROR, "verifier_unavailable", f"{error}")
                if job is not None:
                    job.finish(JobStatus.FAILED, "verifier_unavailable")
            return
        from django.core.files.storage import default_storage

        progress = IngestProgress(job, self.transcript.size)
        try:
            with (
                default_storage.open(self.transcript.storage_name, "rb") as handle,
                self._probes_file() as probes,
            ):
                report = verify_transcript(handle, probes_path=probes, on_progress=progress)
        except Exception as error:
            # Not the transcript's fault (the verifier never raises for bad data): record
            # it where users see it rather than leave the proof "verifying" for ever.
            log.exception("verifying proof %s failed", self.pk)
            with transaction.atomic():
                self._record(
                    ProofStatus.ERROR, "verifier_failed", f"{type(error).__name__}: {error}"
                )
                if job is not None:
                    job.finish(JobStatus.FAILED, "verifier_failed")
            return
        # The verdict, its audit event, the challenges and the job's end are one
        # transaction: a database lost between them (a restart mid-ingest) must not leave
        # a final proof whose job runs for ever, or a verdict without its audit event;
        # the task's retry then finds the proof to verify again.
        with transaction.atomic():
            self.report = report.to_dict()
            self.steps = report.steps
            self.checks = report.checks
            self.transcript_digest = report.digest or ""
            root = report.root if isinstance(report.root, Mapping) else None
            self.prover = str(root.get("prover", "")) if root else ""
            if not report.ok:
                self._record(
                    ProofStatus.REJECTED,
                    report.reason or "rejected",
                    report.message or "",
                    record=report.record,
                    field=report.field or "",
                )
            elif (mismatch := self.experiment.check_identity(root)) is not None:
                self._record(
                    ProofStatus.REJECTED, mismatch[0], mismatch[1], record=0, field=mismatch[2]
                )
            else:
                named = root["experiment"]  # type: ignore[index]
                self.spec = self.experiment.specs.get(digest=named["spec_digest"])
                from attestations import replay

                if replay.replayable(root):
                    # The transcript is consistent; now the platform stops trusting the
                    # trainer: its challenges decide the verdict (attestations/replay.py).
                    replay.draw(self)
                elif settings.DVBENCH.get("REQUIRE_PROGRAM", True):
                    # Without a program no step can be replayed, so accepting it would let a
                    # forger escape every challenge just by leaving the program out.
                    self._record(ProofStatus.REJECTED, *NO_PROGRAM, record=0, field="root.program")
                else:
                    # Opted out (DVBENCH_REQUIRE_PROGRAM=false): the offline verdict stands.
                    self._record(ProofStatus.VALID, "", "")
            if job is not None:
                job.finish(JobStatus.SUCCEEDED, self.reason)
            if self.status in {ProofStatus.VALID, ProofStatus.REJECTED} and not self.is_duplicate:
                # Final at ingest (no challenges to wait for): certify it now, as
                # ``replay.settle`` does after the last challenge. A duplicate is certified
                # by the proof it repeats.
                self._certify_on_commit()

    def _certify_on_commit(self) -> None:
        from attestations.certificate_tasks import issue_certificate

        proof_id = self.pk
        transaction.on_commit(lambda: issue_certificate.delay(proof_id))

    @contextmanager
    def _probes_file(self) -> Iterator[str | None]:
        """A local copy of the attached ``probes.bin``, if any, for the verifier to check.

        The SDK attaches it after filing the transcript, so at a first ingest it is
        usually absent and the first replay checks it (``replay.check_probes``); when it
        is here (a re-ingest), every probe is checked against the transcript's digests.
        """
        from django.core.files.storage import default_storage

        artifact = self.artifacts.filter(name=PROBES_ARTIFACT).select_related("blob").first()
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

    def _record(
        self, status: str, reason: str, message: str, *, record: int | None = None, field: str = ""
    ) -> None:
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
        constraints = [
            models.UniqueConstraint(fields=["proof", "name"], name="proof_artifact_name_unique")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} of proof {self.proof_id}"


class ChallengeOrigin(models.TextChoices):
    GENESIS = "genesis", "Genesis (step 0)"
    SELF_CHECKED = "self_checked", "Self-checked by the trainer"
    RANDOM = "random", "Random"
    WINDOW = "window", "Window"


class ChallengeStatus(models.TextChoices):
    """A challenge's life: answered (``ready``), replayed, and a final verdict."""

    PENDING = "pending", "Awaiting files"
    READY = "ready", "Ready to replay"
    REPLAYING = "replaying", "Replaying"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"
    ERROR = "error", "Replay error"


#: Challenge states that no longer change.
CHALLENGE_FINAL = frozenset(
    {ChallengeStatus.PASSED, ChallengeStatus.FAILED, ChallengeStatus.EXPIRED, ChallengeStatus.ERROR}
)


class Challenge(models.Model):
    """One step (or window, up to ``through``) of a proof the platform replays."""

    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, related_name="challenges")
    step = models.PositiveIntegerField()
    through = models.PositiveIntegerField(null=True, blank=True)
    origin = models.CharField(max_length=16, choices=ChallengeOrigin.choices)
    status = models.CharField(
        max_length=16,
        choices=ChallengeStatus.choices,
        default=ChallengeStatus.PENDING,
        db_index=True,
    )
    #: Proof-directory names the replay reads (snapshot files, batch files).
    needed_files = models.JSONField(default=list)
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    evidence = models.JSONField(null=True, blank=True)
    steps_total = models.PositiveIntegerField(default=0)
    steps_replayed = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    answered = models.DateTimeField(null=True, blank=True)
    claimed = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["proof", "step", "through"],
                name="challenge_step_unique",
                nulls_distinct=False,
            )
        ]
        ordering = ["step", "through"]

    def __str__(self) -> str:
        span = f"{self.step}..{self.through}" if self.through is not None else f"{self.step}"
        return f"challenge {span} of proof {self.proof_id} ({self.status})"

    @property
    def is_final(self) -> bool:
        return self.status in CHALLENGE_FINAL


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


class WorkerHeartbeat(models.Model):
    """A row written by a Celery worker: proof that the broker and worker round-trip works."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"heartbeat {self.token} from {self.hostname}"


# Certificates, signing keys and the transparency log live in their own module; importing
# it here registers those models with this app.
from attestations.certificate_models import *  # noqa: E402, F403
