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
