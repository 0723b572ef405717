"""Stored bytes and the resumable uploads that bring them.

A :class:`Blob` is stored once under its content address, whoever uploaded it; an
:class:`Upload` is one resumable multipart session of one file (a transcript, a program,
a snapshot, a batch), whose parts are checked as they arrive. Moving bytes through
storage is ``attestations/uploads/services.py`` and the modules it names.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import models
from django.utils import timezone

from attestations.accounts.models import Organization
from attestations.core.validators import sha256_validator
from attestations.experiments.models import Experiment


class Blob(models.Model):
    """Bytes stored once under their content address, whoever uploaded them."""

    sha256 = models.CharField(max_length=64, unique=True, validators=[sha256_validator])
    size = models.PositiveBigIntegerField()
    storage_name = models.CharField(max_length=255)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_blob"

    def __str__(self) -> str:
        return f"sha256:{self.sha256}"

    @staticmethod
    def address(sha256: str) -> str:
        """The storage name of a blob: fanned out so no directory holds millions of files."""
        return f"blobs/sha256/{sha256[:2]}/{sha256[2:4]}/{sha256}"


class ArtifactKind(models.TextChoices):
    TRANSCRIPT = "transcript", "Transcript"
    ARTIFACT = "artifact", "Program artifact"
    SNAPSHOT = "snapshot", "State snapshot"
    BATCH = "batch", "Batch"
    GRADIENT = "gradient", "Gradient"


class UploadStatus(models.TextChoices):
    OPEN = "open", "Open"
    COMPLETING = "completing", "Completing"
    COMPLETE = "complete", "Complete"
    ABORTED = "aborted", "Aborted"
    FAILED = "failed", "Failed"


class Upload(models.Model):
    """A resumable multipart upload session; see ``attestations/uploads/services.py``."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="uploads")
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    #: The file's path in the proof directory, as the client names it (informational).
    name = models.CharField(max_length=255, blank=True)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, validators=[sha256_validator])
    status = models.CharField(
        max_length=16, choices=UploadStatus.choices, default=UploadStatus.OPEN
    )
    reason = models.CharField(max_length=64, blank=True)
    #: S3's id of the multipart upload a direct upload's parts go to (``uploads/s3.py``);
    #: empty when the parts go through the API. Never shown to clients.
    s3_upload_id = models.CharField(max_length=1024, blank=True, default="")
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, null=True, related_name="uploads")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    completed = models.DateTimeField(null=True, blank=True)
    #: A transcript already filed for the experiment: completing this upload filed nothing
    #: new, and this is the proof it is (``attestations.proofs.filing``).
    duplicate_of = models.ForeignKey(
        "proofs.Proof",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="refilings",
    )

    class Meta:
        db_table = "attestations_upload"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"upload {self.id} ({self.kind}, {self.status})"

    @property
    def filed_proof_id(self) -> int | None:
        """The proof this transcript upload filed, or the earlier one it duplicates."""
        try:
            return self.proof.pk
        except ObjectDoesNotExist:  # the proofs app's Proof, which this app never imports
            return self.duplicate_of_id

    @property
    def direct(self) -> bool:
        """Whether the client PUTs the parts straight to S3 through presigned URLs."""
        return bool(self.s3_upload_id)

    @property
    def staging_object(self) -> str:
        """The storage name a direct upload's parts are assembled under, in S3."""
        return f"{self.staging_prefix}/object"

    @property
    def staging_prefix(self) -> str:
        return f"staging/uploads/{self.id}"

    def part_name(self, number: int) -> str:
        return f"{self.staging_prefix}/{number:05d}"

    @property
    def received_bytes(self) -> int:
        # Summed in Python so that a prefetched parts list costs no query.
        return sum(part.size for part in self.parts.all())


class UploadPart(models.Model):
    """A part received (staged under ``storage_name``), or, for a direct upload, a part
    declared (its size and SHA-256, bound into its presigned URL; ``storage_name`` empty):
    what S3 holds is checked against it at completion."""

    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="parts")
    number = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    storage_name = models.CharField(max_length=255)
    created = models.DateTimeField(default=timezone.now)
    # The whole file's SHA-256 state before and after this part's bytes (see
    # ``uploads.sha256state``), when the part was hashed on from the part before it:
    # completion takes up the last state of the unbroken chain from part 1 and hashes
    # only what follows it. Empty when the part came before its predecessor.
    chain_base = models.BinaryField(null=True, blank=True, editable=False)
    chain = models.BinaryField(null=True, blank=True, editable=False)
    # Where the part's bytes start in the file ``storage_name`` names: set for a part
    # written in place into the upload's data file (``uploads.disk``), else None (the
    # part is a file of its own).
    offset = models.PositiveBigIntegerField(
        null=True, blank=True, editable=False, db_column="data_offset"
    )

    class Meta:
        db_table = "attestations_uploadpart"
        constraints = [
            models.UniqueConstraint(fields=["upload", "number"], name="part_number_unique")
        ]
        ordering = ["number"]

    def __str__(self) -> str:
        return f"part {self.number} of {self.upload_id}"


class PartReservation(models.Model):
    """Bytes a part PUT in flight has claimed against its upload's declared size.

    Taken under the upload's row lock before the part's body is read, and released when
    the part is registered or refused (``attestations/uploads/parts.py``), so parts
    sent in parallel never stage more than was declared. A reservation older than
    ``services.RESERVATION_SECONDS`` belongs to a request that died without releasing it
    (a killed worker) and no longer counts.
    """

    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="reservations")
    number = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_partreservation"

    def __str__(self) -> str:
        return f"{self.size} bytes for part {self.number} of {self.upload_id}"
