"""Challenges: the steps (or windows) of a proof the platform replays, and their states."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from attestations.proofs.models import Proof


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
    #: No worker of the run's platform kind could replay it (``routing.NO_REPLAY_WORKER``):
    #: no replay verdict, and the certificate says so.
    UNREPLAYED = "unreplayed", "Not replayed (no worker of its platform kind)"


#: Challenge states that no longer change.
CHALLENGE_FINAL = frozenset(
    {
        ChallengeStatus.PASSED,
        ChallengeStatus.FAILED,
        ChallengeStatus.EXPIRED,
        ChallengeStatus.ERROR,
        ChallengeStatus.UNREPLAYED,
    }
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
        db_table = "attestations_challenge"
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


class SlicedRunStatus(models.TextChoices):
    """A sliced run's life: challenged until every slice is final, then its verdict."""

    CHALLENGED = "challenged", "Challenged"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"


class SlicedRun(models.Model):
    """A run filed for sliced challenges (``docs/scale.md``): its run file and its verdict.

    The run file (``zkdv.sliced.RunFile``) is an uploaded blob; its SHA-256 is the run's
    identity, from which the platform's seed derives, so the same run filed again (in
    any organisation) faces the same slices. The seed stays the platform's secret until
    the run is settled; only its SHA-256 is shown before.
    """

    experiment = models.ForeignKey(
        "experiments.Experiment", on_delete=models.CASCADE, related_name="sliced_runs"
    )
    run_file = models.ForeignKey(
        "uploads.Blob", on_delete=models.PROTECT, related_name="sliced_runs"
    )
    digest = models.CharField(max_length=64, db_index=True)
    steps = models.PositiveIntegerField()
    blocks = models.PositiveIntegerField()
    micro_batches = models.PositiveIntegerField()
    rows = models.PositiveIntegerField()
    status = models.CharField(
        max_length=16,
        choices=SlicedRunStatus.choices,
        default=SlicedRunStatus.CHALLENGED,
        db_index=True,
    )
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    seed = models.CharField(max_length=64)
    seed_commitment = models.CharField(max_length=64)
    deadline = models.DateTimeField()
    created_by = models.ForeignKey(
        "auth.User", on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    settled = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "attestations_slicedrun"
        constraints = [
            models.UniqueConstraint(
                fields=["experiment", "digest"], name="sliced_run_digest_unique"
            )
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"sliced run {self.pk} of {self.experiment_id} ({self.status})"


class SliceStatus(models.TextChoices):
    """One slice: answered (projections), opened, verified, and its verdict."""

    AWAITING_ANSWER = "awaiting_answer", "Awaiting the projections"
    AWAITING_OPENING = "awaiting_opening", "Awaiting the opening"
    READY = "ready", "Ready to verify"
    VERIFYING = "verifying", "Verifying"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"
    ERROR = "error", "Verification error"


#: Slice states that no longer change.
SLICE_FINAL = frozenset(
    {SliceStatus.PASSED, SliceStatus.FAILED, SliceStatus.EXPIRED, SliceStatus.ERROR}
)


class SlicedChallenge(models.Model):
    """One sliced challenge of a run: ``(step, block)``, the lab's answer, its opening."""

    run = models.ForeignKey(SlicedRun, on_delete=models.CASCADE, related_name="challenges")
    index = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    block = models.PositiveIntegerField()
    #: The Freivalds directions' seed (hex): the lab needs it to answer.
    directions = models.CharField(max_length=64)
    projections = models.PositiveIntegerField()
    opened = models.PositiveIntegerField()
    status = models.CharField(
        max_length=20,
        choices=SliceStatus.choices,
        default=SliceStatus.AWAITING_ANSWER,
        db_index=True,
    )
    #: The lab's projections, little-endian float64 ``(projections, micro_batches, rows)``.
    answer = models.BinaryField(null=True, blank=True)
    answer_digest = models.CharField(max_length=64, blank=True)
    #: The ``[micro, row]`` sequences drawn once the answer is in.
    sequences = models.JSONField(default=list)
    opening = models.ForeignKey(
        "uploads.Blob", on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    #: Or the lab's read grant (``zkdv.sliced_store.Grant``) on its own bucket, from which
    #: the worker reads the opened ranges.
    grant = models.JSONField(null=True, blank=True)
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    margins = models.JSONField(default=dict)
    seconds = models.FloatField(null=True, blank=True)
    #: Bytes the platform received for this slice (answer and opening).
    bytes_moved = models.PositiveBigIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    answered = models.DateTimeField(null=True, blank=True)
    claimed = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "attestations_slicechallenge"
        constraints = [
            models.UniqueConstraint(fields=["run", "index"], name="slice_challenge_index_unique")
        ]
        ordering = ["index"]

    def __str__(self) -> str:
        return f"slice {self.index} (step {self.step}, block {self.block}) of run {self.run_id}"

    @property
    def is_final(self) -> bool:
        return self.status in SLICE_FINAL


class CommittedState(models.Model):
    """A committed post-step parameter root of a challenged proof, every few steps.

    Filings of one run share a run digest; a *near copy* (a run refiled with a step
    changed, re-chained) has a new digest but the same committed states up to the change,
    so the compute of those steps is claimed twice. Indexed by root, so the filings that
    share any state are found wherever they were filed (``draw.shared_state_filings``).
    """

    proof = models.ForeignKey(Proof, on_delete=models.CASCADE, related_name="committed_states")
    step = models.PositiveIntegerField()
    root = models.CharField(max_length=64, db_index=True)

    class Meta:
        db_table = "attestations_committedstate"
        constraints = [
            models.UniqueConstraint(fields=["proof", "step"], name="committed_state_step_unique")
        ]

    def __str__(self) -> str:
        return f"state after step {self.step} of proof {self.proof_id}"
