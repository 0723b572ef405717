"""Signing keys, the trust root, attestation certificates and the transparency log (models).

What lives where:

* :class:`PlatformKey`: the *public* half of every key the platform has signed with and
  its validity window. Private keys never enter the database: they come from
  ``DVBENCH_SIGNING_KEY_FILE`` / ``DVBENCH_SIGNING_KEY`` or from
  ``$DVBENCH_DATA_DIR/keys/`` (see ``attestations/certificates/keys.py``).
* :class:`TrustRootVersion`: every published trust root document, verbatim. A bundle
  carries the version a certificate was signed under, so old versions are kept.
* :class:`LogEntry` and :class:`LogCheckpoint`: the RFC 9162 Merkle log of issued
  certificates and its signed checkpoints. A leaf is the Rekor ``dsse`` entry of a
  certificate's DSSE envelope (before that kind: the envelope's canonical JSON), and
  the envelope is stored beside it, once, here.
* :class:`Certificate`: one per proof (a unique constraint, so a retried task can never
  issue twice), with the searchable facts a regulator filters on.

Log entries, checkpoints, trust root versions and certificates are append-only: the
model layer refuses updates and deletes (:class:`~attestations.core.db.AppendOnlyError`),
and on PostgreSQL a trigger (migration ``0003_append_only``) refuses them in SQL too.
``manage.py verify_log`` finds rows altered behind both guards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from django.db import models
from django.utils import timezone

from attestations.core.conf import api_datetime
from attestations.core.db import AppendOnlyModel, AppendOnlyQuerySet
from attestations.core.validators import sha256_validator
from dvbench.attest import Envelope, TrustRoot, entry_kind

__all__ = [
    "Certificate",
    "CertificateResult",
    "LogCheckpoint",
    "LogEntry",
    "PlatformKey",
    "TrustRootVersion",
]


class KeySource(models.TextChoices):
    GENERATED = "generated", "Generated under the data directory"
    CONFIGURED = "configured", "DVBENCH_SIGNING_KEY_FILE or DVBENCH_SIGNING_KEY"
    IMPORTED = "imported", "Imported from a PEM file by rotate_signing_key"


class PlatformKey(models.Model):
    """The public half of a signing key and the window in which it may sign.

    ``not_after`` is set once, when a rotation retires the key; every other field is
    fixed at creation. The private key is never stored here.
    """

    keyid = models.CharField(max_length=64, unique=True, validators=[sha256_validator])
    public_key = models.TextField(help_text="PEM SubjectPublicKeyInfo")
    not_before = models.DateTimeField()
    not_after = models.DateTimeField(null=True, blank=True)
    source = models.CharField(max_length=16, choices=KeySource.choices)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_platformkey"
        ordering = ["not_before"]

    def __str__(self) -> str:
        return f"key {self.keyid[:16]}… ({'current' if self.not_after is None else 'retired'})"

    @property
    def is_current(self) -> bool:
        return self.not_after is None


class TrustRootVersion(AppendOnlyModel):
    """One published version of the trust root, as the exact canonical JSON served."""

    objects: ClassVar[AppendOnlyQuerySet[TrustRootVersion]] = AppendOnlyQuerySet.as_manager()  # type: ignore[assignment]

    version = models.PositiveIntegerField(unique=True)
    document = models.TextField(help_text="canonical JSON of the trust root")
    digest = models.CharField(max_length=64, validators=[sha256_validator])
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_trustrootversion"
        ordering = ["-version"]

    def __str__(self) -> str:
        return f"trust root v{self.version}"

    def trust_root(self) -> TrustRoot:
        """The parsed document (checked: key ids, canonical PEM, windows)."""
        return TrustRoot.from_json(self.document)


class LogEntry(AppendOnlyModel):
    """Leaf ``index`` of the transparency log.

    ``leaf`` is the RFC 9162 leaf input: the canonicalized body of a Rekor ``dsse``
    entry for the certificate's envelope (``dvbench.attest._rekor``), or, for entries
    logged before that kind, the canonical JSON of the envelope itself.
    ``envelope_json`` is the envelope's canonical JSON (empty for those older entries,
    whose leaf is the envelope); ``inclusion_promise`` the log's signed entry timestamp
    and ``rfc3161_timestamp`` the platform timestamp authority's response over the
    envelope's signature (base64; both empty for older entries). ``leaf_hash`` is ``SHA-256(0x00 || leaf)``,
    stored so proofs need no re-hashing; ``verify_log`` recomputes it, and the leaf from
    the envelope, to detect an altered row.
    """

    objects: ClassVar[AppendOnlyQuerySet[LogEntry]] = AppendOnlyQuerySet.as_manager()  # type: ignore[assignment]

    index = models.PositiveBigIntegerField(unique=True)
    leaf = models.TextField()
    leaf_hash = models.CharField(max_length=64, validators=[sha256_validator])
    envelope_json = models.TextField(blank=True, default="")
    inclusion_promise = models.TextField(blank=True, default="")
    rfc3161_timestamp = models.TextField(blank=True, default="")
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "attestations_logentry"
        ordering = ["index"]
        verbose_name_plural = "log entries"

    def __str__(self) -> str:
        return f"log entry {self.index}"

    @property
    def envelope(self) -> Envelope:
        """The certificate's DSSE envelope, as distributed."""
        value: Envelope = json.loads(self.envelope_json or self.leaf)
        return value

    @property
    def kind(self) -> dict[str, str]:
        """The entry's kind (``{"kind", "version"}``), as a Sigstore bundle names it."""
        return entry_kind(self.leaf.encode("utf-8"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "leaf_hash": self.leaf_hash,
            "envelope": self.envelope,
            "created": api_datetime(self.created),
        }


class LogCheckpoint(AppendOnlyModel):
    """A signed checkpoint of the log at ``tree_size`` (one is signed per append)."""

    objects: ClassVar[AppendOnlyQuerySet[LogCheckpoint]] = AppendOnlyQuerySet.as_manager()  # type: ignore[assignment]

    tree_size = models.PositiveBigIntegerField(unique=True)
    root_hash = models.CharField(max_length=64, validators=[sha256_validator])
    note = models.TextField(help_text="the C2SP signed note")
    keyid = models.CharField(max_length=64)
    timestamp = models.DateTimeField()

    class Meta:
        db_table = "attestations_logcheckpoint"
        ordering = ["-tree_size"]

    def __str__(self) -> str:
        return f"checkpoint at size {self.tree_size}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "timestamp": api_datetime(self.timestamp),
            "keyid": self.keyid,
            "note": self.note,
        }


class CertificateResult(models.TextChoices):
    PASSED = "PASSED", "Passed"
    FAILED = "FAILED", "Failed"


class Certificate(AppendOnlyModel):
    """The signed attestation of one proof's final verdict.

    The envelope itself is ``log_entry.leaf``; the columns here repeat the facts that
    regulators search on (organisation, time, FLOPs, tokens, result), which ``verify_log``
    checks against the signed statement.
    """

    objects: ClassVar[AppendOnlyQuerySet[Certificate]] = AppendOnlyQuerySet.as_manager()  # type: ignore[assignment]

    proof = models.OneToOneField(
        "proofs.Proof", on_delete=models.PROTECT, related_name="certificate"
    )
    organization = models.ForeignKey(
        "accounts.Organization", on_delete=models.PROTECT, related_name="certificates"
    )
    experiment = models.CharField(max_length=151, help_text="owner/name")
    result = models.CharField(max_length=8, choices=CertificateResult.choices, db_index=True)
    flops = models.DecimalField(max_digits=40, decimal_places=0, null=True, db_index=True)
    tokens = models.DecimalField(max_digits=40, decimal_places=0, null=True, db_index=True)
    #: The signed ``lineage`` claim's total: this run's FLOPs and its parent runs'
    #: (null before lineages were certified, or when undetermined).
    lineage_flops = models.DecimalField(max_digits=40, decimal_places=0, null=True, db_index=True)
    issued = models.DateTimeField(db_index=True)
    keyid = models.CharField(max_length=64)
    trust_root_version = models.PositiveIntegerField()
    transcript_digest = models.CharField(max_length=64)
    final_parameter_root = models.CharField(max_length=64)
    log_entry = models.OneToOneField(LogEntry, on_delete=models.PROTECT, related_name="certificate")

    class Meta:
        db_table = "attestations_certificate"
        ordering = ["-issued", "-id"]

    def __str__(self) -> str:
        return f"certificate of proof {self.proof_id} ({self.result})"

    @property
    def envelope(self) -> Envelope:
        return self.log_entry.envelope

    @property
    def log_index(self) -> int:
        return self.log_entry.index

    @property
    def passed(self) -> bool:
        return self.result == CertificateResult.PASSED

    @staticmethod
    def certifies(transcript_digest: str, orgs: models.Q | None = None) -> bool:
        """Whether a certificate certifies the run ``transcript_digest``, among those of
        the organisations ``orgs`` selects (a reader's): a spec may name such a run as
        its parent (``ExperimentSpec.parent_transcript``)."""
        found = Certificate.objects.filter(transcript_digest=transcript_digest)
        return (found if orgs is None else found.filter(orgs)).exists()

    def statement(self, envelope: Envelope | None = None) -> dict[str, Any]:
        """The signed in-toto statement, decoded for display (verify the envelope to trust it).

        ``envelope``: this certificate's, when the caller has read it already.
        """
        import base64

        payload = (envelope or self.envelope)["payload"]
        document: dict[str, Any] = json.loads(base64.b64decode(payload))
        return document

    def claims(self) -> list[dict[str, Any]]:
        """The claims as signed (name, value, evidence, unit), for templates."""
        claims: list[dict[str, Any]] = self.statement()["predicate"]["claims"]
        return claims

    def to_dict(self) -> dict[str, Any]:
        """The API representation (``CertificateSerializer`` documents it)."""
        # The envelope and its statement are read once: a list page builds 50 of these.
        envelope = self.envelope
        predicate = self.statement(envelope)["predicate"]
        signed: dict[str, Any] = {}
        for claim in predicate["claims"]:
            signed.setdefault(claim.get("name"), claim.get("value"))
        return {
            "id": self.pk,
            "proof": self.proof_id,
            "organization": self.organization.slug,
            "experiment": self.experiment,
            "result": self.result,
            "flops": None if self.flops is None else int(self.flops),
            "tokens": None if self.tokens is None else int(self.tokens),
            "lineage_flops": None if self.lineage_flops is None else int(self.lineage_flops),
            "lineage": signed.get("lineage"),
            "issued": api_datetime(self.issued),
            "keyid": self.keyid,
            "trust_root_version": self.trust_root_version,
            "transcript_digest": self.transcript_digest,
            "final_parameter_root": self.final_parameter_root,
            "log_index": self.log_index,
            "regulatory_thresholds": signed.get("regulatory_thresholds") or [],
            "limit_violations": signed.get("limit_violations") or [],
            "filings": predicate.get("filings"),
            "envelope": envelope,
        }

    def claim_value(self, name: str) -> Any:
        """The signed value of the claim ``name`` (None when the certificate has none)."""
        for claim in self.claims():
            if claim.get("name") == name:
                return claim.get("value")
        return None

    def filings(self) -> dict[str, Any] | None:
        """The signed record of every proof filed for the experiment (None before it existed)."""
        filings: dict[str, Any] | None = self.statement()["predicate"].get("filings")
        return filings

    def run_filings(self, can_see: Callable[[int], bool]) -> dict[str, Any] | None:
        """Every filing of the certified run outside its experiment, now, for one reader.

        The signed ``filings.run`` lists them by date and verdict only. This reads them
        from the database as they stand and names each one's organisation, experiment
        and proof where ``can_see(organisation id)`` (a regulator: every one; a lab's
        member: their own lab's), and leaves those three null elsewhere: another lab's
        identity is not a lab's to see. ``shared_states`` lists, named the same way, the
        filings that committed any state the certified proof committed
        (``draw.shared_state_filings``). None when the proof was never challenged.
        """
        from attestations.challenges.draw import STATE_STRIDE, shared_state_filings
        from attestations.proofs.models import Proof

        proof = Proof.objects.get(pk=self.proof_id)
        digest = proof.challenge_run_digest
        if not digest:
            return None
        rows = (
            Proof.objects.filter(challenge_run_digest=digest, challenges_drawn__isnull=False)
            .exclude(experiment_id=proof.experiment_id)
            .select_related("experiment__owner")
            .order_by("created", "pk")
        )
        filings = [
            {
                **self._filing(row, can_see),
                "reason": row.reason,
                "challenge_target": row.challenge_target,
            }
            for row in rows
        ]
        # Filings anywhere (this experiment's too) that committed a state the certified
        # proof committed: refilings of its run, and near copies with a new run digest (a
        # step changed and re-chained), whose shared steps' compute is claimed twice.
        shared = [
            {
                **self._filing(row, can_see),
                "same_run": row.challenge_run_digest == digest,
                "shared_states": count,
                "state_stride": STATE_STRIDE,
            }
            for row, count in shared_state_filings(proof)
        ]
        return {
            "run_digest": digest,
            "count": len(filings),
            "filings": filings,
            "shared_states": shared,
        }

    def _filing(self, row: Any, can_see: Callable[[int], bool]) -> dict[str, Any]:
        """Another proof as this certificate's reader may see it: its organisation,
        experiment and proof only where ``can_see`` its organisation."""
        owner = row.experiment.owner
        shown = can_see(owner.pk)
        return {
            "organization": owner.slug if shown else None,
            "experiment": row.experiment.full_name if shown else None,
            "proof": row.pk if shown else None,
            "same_organization": owner.pk == self.organization_id,
            "status": str(row.status),
            "filed_on": api_datetime(row.created),
            "transcript_digest": row.transcript_digest,
        }
