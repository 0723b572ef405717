"""Experiments registered in advance, and the versions of their declared spec.

An experiment is ``owner/name``; its spec declares the framework, model, optimizer,
dataset commitment and limits (FLOPs, tokens, GPU-hours, regimes) before training. A
spec is edited in place until a proof names it, then frozen: a change becomes a new
version. Its digest (SHA-256 of a canonical document) goes into the transcript, which
binds the run to what was declared.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any, ClassVar

from django.conf import settings
from django.contrib.auth.models import User
from django.core.validators import RegexValidator
from django.db import models, transaction
from django.utils import timezone

import dvbench
from attestations.accounts.models import Access, Capability, Organization
from attestations.audit.models import AuditEvent
from attestations.core.conf import api_datetime
from attestations.core.validators import sha256_validator
from zkdv.config import DEFAULT_TOKEN_UNIT, TOKEN_UNITS
from zkdv.environments import PLATFORM_KINDS, platform_kind

EXPERIMENT_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$")
experiment_name_validator = RegexValidator(
    EXPERIMENT_NAME,
    "Use 1-100 lowercase letters, digits, '.', '_' or '-', starting and ending with a letter "
    "or digit.",
)


class Framework(models.TextChoices):
    JAX = "jax", "JAX"
    TORCH = "torch", "PyTorch"


class Regime(models.TextChoices):
    PRETRAINING = "pretraining", "Pre-training"
    CONTINUED_PRETRAINING = "continued-pretraining", "Continued pre-training"
    FINE_TUNING = "fine-tuning", "Supervised fine-tuning"
    RL = "rl", "Reinforcement learning"
    DISTILLATION = "distillation", "Distillation"


def proof_statuses() -> list[str]:
    """Every status a proof can have, in the proofs app's order.

    Read from the reverse relation's model: the proofs app sits above this one, so this
    app imports nothing of it.
    """
    proof = Experiment._meta.get_field("proofs").related_model
    status = proof._meta.get_field("status")
    assert isinstance(status, models.Field) and status.choices is not None
    return [str(value) for value, _ in status.flatchoices]


def certificate_results() -> list[str]:
    """Every result a certificate can record (PASSED, FAILED), in the certificates app's order.

    Read through the proofs' reverse relation to their certificate: the certificates app
    sits above this one, so this app imports nothing of it.
    """
    proof = Experiment._meta.get_field("proofs").related_model
    certificate = proof._meta.get_field("certificate").related_model
    assert certificate is not None
    result = certificate._meta.get_field("result")
    assert isinstance(result, models.Field) and result.choices is not None
    return [str(value) for value, _ in result.flatchoices]


#: What a lab declares in a spec version: the fields its digest covers.
DECLARED_FIELDS = (
    "framework",
    "model_description",
    "optimizer",
    "dataset_commitment",
    "max_flops",
    "max_tokens",
    "max_gpu_hours",
    "allowed_regimes",
    "token_unit",
    "parent_transcript",
    "platform_kind",
)

#: The fields of a spec version its API representation shows (with ``frozen``).
SPEC_FIELDS = ("version", "digest", *DECLARED_FIELDS, "created")

#: The columns of :meth:`ExperimentQuerySet.summary_rows` (``created`` and ``id`` order a page).
SUMMARY_COLUMNS = (
    "id",
    "current_spec_id",
    "name",
    "created",
    "owner__slug",
    "created_by__username",
    *(f"current_spec__{field}" for field in SPEC_FIELDS),
)


#: ``(spec field, summary column)`` pairs, for :func:`summary_dict`.
_SPEC_COLUMNS = tuple((field, f"current_spec__{field}") for field in SPEC_FIELDS)


def spec_document(values: Mapping[str, Any], frozen: bool) -> dict[str, Any]:
    """A spec version's API representation from its field values (``SpecSerializer``'s)."""
    max_flops, max_tokens = values["max_flops"], values["max_tokens"]
    max_gpu_hours = values["max_gpu_hours"]
    return {
        "version": values["version"],
        "digest": values["digest"],
        "frozen": frozen,
        "framework": values["framework"],
        "model_description": values["model_description"],
        "optimizer": values["optimizer"],
        "dataset_commitment": values["dataset_commitment"],
        "max_flops": None if max_flops is None else int(max_flops),
        "max_tokens": None if max_tokens is None else int(max_tokens),
        "max_gpu_hours": None if max_gpu_hours is None else float(max_gpu_hours),
        "allowed_regimes": list(values["allowed_regimes"]),
        "token_unit": values["token_unit"],
        "parent_transcript": values["parent_transcript"] or None,
        "platform_kind": values["platform_kind"] or None,
        "created": api_datetime(values["created"]),
    }


def summary_dict(row: Mapping[str, Any], statuses: Iterable[str]) -> dict[str, Any]:
    """The API representation of a :meth:`~ExperimentQuerySet.summary_rows` row.

    The same document as :meth:`Experiment.to_dict` (a test keeps them identical);
    ``statuses`` is :func:`proof_statuses`, read once per page.
    """
    return {
        "id": f"{row['owner__slug']}/{row['name']}",
        "owner": row["owner__slug"],
        "name": row["name"],
        "spec_digest": row["current_spec__digest"],
        "spec": spec_document(
            {field: row[column] for field, column in _SPEC_COLUMNS}, bool(row["spec_frozen"])
        ),
        "created": api_datetime(row["created"]),
        "created_by": row["created_by__username"],
        "proofs": {s: row[f"proofs_{s}"] for s in statuses if row[f"proofs_{s}"]},
        "certificates": {
            r: row[f"certificates_{r}"]
            for r in certificate_results()
            if row.get(f"certificates_{r}")
        },
    }


class ExperimentQuerySet(models.QuerySet["Experiment"]):
    def visible_to(self, access: Access) -> ExperimentQuerySet:
        return self.filter(access.orgs(Capability.READ, "owner_id"))

    def with_summary(self) -> ExperimentQuerySet:
        """What an experiment's representation reads; see :meth:`Experiment.summarize`."""
        return self.select_related("owner", "current_spec", "created_by")

    def summary_rows(self) -> models.QuerySet[Experiment, dict[str, Any]]:
        """One row per experiment with all that its representation reads, in one query.

        Plain rows (``.values()``) with the owner, the creator and the current spec
        joined, proof counts by status and the spec's frozen flag as annotations. Turn a
        row into the representation with :func:`summary_dict`, which equals
        :meth:`Experiment.to_dict`. The API's list and detail read the same rows through
        :class:`~attestations.experiments.rows.SummaryPage` instead (cached SQL, and counts
        grouped over the page only: this query aggregates every matching experiment
        before its LIMIT).
        """
        proofs = Experiment._meta.get_field("proofs").related_model
        counts = {
            f"proofs_{status}": models.Count("proofs", filter=models.Q(proofs__status=status))
            for status in proof_statuses()
        }
        # A proof has at most one certificate: counting through it multiplies no row.
        counts.update(
            {
                f"certificates_{result}": models.Count(
                    "proofs__certificate", filter=models.Q(proofs__certificate__result=result)
                )
                for result in certificate_results()
            }
        )
        frozen = models.Exists(
            proofs._default_manager.filter(spec_id=models.OuterRef("current_spec_id"))
        )
        rows: models.QuerySet[Experiment, dict[str, Any]] = self.values(*SUMMARY_COLUMNS).annotate(
            **counts, spec_frozen=frozen
        )
        return rows

    def by_full_name(self, full_name: str) -> ExperimentQuerySet:
        owner, _, name = full_name.partition("/")
        return self.filter(owner__slug=owner, name=name)


class Experiment(models.Model):
    """A training run registered in advance, identified as ``owner/name``."""

    owner = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="experiments")
    name = models.CharField(max_length=100, validators=[experiment_name_validator])
    current_spec = models.ForeignKey(
        "ExperimentSpec", on_delete=models.PROTECT, null=True, related_name="+"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    objects: ClassVar[ExperimentQuerySet] = ExperimentQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        db_table = "attestations_experiment"
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="experiment_name_per_owner")
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return self.full_name

    @property
    def full_name(self) -> str:
        return f"{self.owner.slug}/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        """The API representation, built directly (as healthchecks' ``Check.to_dict``).

        ``ExperimentSerializer`` validates input and documents this shape in the OpenAPI
        schema; building the output here is several times cheaper on a list page, and a
        test keeps the two identical.
        """
        spec = self.current_spec
        assert spec is not None
        return {
            "id": self.full_name,
            "owner": self.owner.slug,
            "name": self.name,
            "spec_digest": spec.digest,
            "spec": spec.to_dict(frozen=getattr(self, "spec_frozen", None)),
            "created": api_datetime(self.created),
            "created_by": self.created_by.get_username() if self.created_by else None,
            "proofs": self.proof_counts(),
            "certificates": self.certificate_counts(),
        }

    @staticmethod
    def summarize(experiments: Iterable[Experiment]) -> None:
        """Attach proof counts and the current spec's frozen flag to many experiments.

        One grouped query for a whole page (proofs by experiment, status and spec),
        instead of two per experiment; a spec is frozen when some proof names it.
        """
        rows = {experiment.pk: experiment for experiment in experiments}
        if not rows:
            return
        for experiment in rows.values():
            experiment._counts = {}  # type: ignore[attr-defined]
            experiment._certificate_counts = {}  # type: ignore[attr-defined]
            experiment.spec_frozen = False  # type: ignore[attr-defined]
        # Through the reverse relation: the proofs app sits above this one.
        grouped = (
            Experiment.objects.filter(pk__in=rows, proofs__isnull=False)
            .order_by()
            .values_list("pk", "proofs__status", "proofs__spec_id")
            .annotate(n=models.Count("proofs"))
        )
        for experiment_id, status, spec_id, n in grouped:
            experiment = rows[experiment_id]
            counts = experiment._counts  # type: ignore[attr-defined]
            counts[status] = counts.get(status, 0) + n
            if spec_id == experiment.current_spec_id:
                experiment.spec_frozen = True  # type: ignore[attr-defined]
        certified = (
            Experiment.objects.filter(pk__in=rows, proofs__certificate__isnull=False)
            .order_by()
            .values_list("pk", "proofs__certificate__result")
            .annotate(n=models.Count("proofs__certificate"))
        )
        for experiment_id, result, n in certified:
            rows[experiment_id]._certificate_counts[result] = n  # type: ignore[attr-defined]

    def certificate_counts(self) -> dict[str, int]:
        """Certificates of its proofs by result (attached by :meth:`summarize`, else one query)."""
        known = getattr(self, "_certificate_counts", None)
        if known is None:
            known = {}
            for result in self.proofs.filter(certificate__isnull=False).values_list(
                "certificate__result", flat=True
            ):
                known[result] = known.get(result, 0) + 1
        return {result: known[result] for result in certificate_results() if known.get(result)}

    def proof_counts(self) -> dict[str, int]:
        """Proofs by status (attached by :meth:`summarize`, else one query)."""
        known = getattr(self, "_counts", None)
        if known is not None:
            return {status: known[status] for status in proof_statuses() if known.get(status)}
        counts: dict[str, int] = {}
        for status in self.proofs.values_list("status", flat=True):
            counts[status] = counts.get(status, 0) + 1
        return counts

    @property
    def organization_id(self) -> int:
        return self.owner_id

    def check_identity(self, root: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
        """Check that a transcript's root names this experiment and one of its spec versions.

        The root must also name the prover of the spec version's framework, and the
        platform kind the spec version declares, where it declares one.

        Returns:
            None when it does, else ``(reason, message, field)``.
        """
        named = root.get("experiment") if isinstance(root, Mapping) else None
        if not isinstance(named, Mapping):
            return (
                "experiment_missing",
                f"the transcript names no experiment; expected {self.full_name}",
                "root.experiment",
            )
        name, digest = named.get("name"), named.get("spec_digest")
        if name != self.full_name:
            return (
                "experiment_mismatch",
                f"the transcript names experiment {name!r}; expected {self.full_name!r}",
                "root.experiment.name",
            )
        spec = self.specs.filter(digest=digest).first()
        if spec is None:
            return (
                "spec_mismatch",
                f"the transcript names spec digest {digest!r}, which is no version of "
                f"{self.full_name} (current: {self.current_spec.digest})",  # type: ignore[union-attr]
                "root.experiment.spec_digest",
            )
        prover = root.get("prover") if isinstance(root, Mapping) else None
        expected = f"whitebox-{spec.framework}"
        if prover != expected:
            return (
                "framework_mismatch",
                f"the transcript was made by prover {prover!r}; spec version {spec.version} "
                f"declares framework {spec.framework!r}, so expected {expected!r}",
                "root.prover",
            )
        trained = platform_kind(root or {})
        if spec.platform_kind and trained != spec.platform_kind:
            return (
                "platform_mismatch",
                f"the transcript's root names platform kind {trained!r}; spec version "
                f"{spec.version} declares the run trains on {spec.platform_kind!r}",
                "root.env.platform_kind",
            )
        return None

    @classmethod
    @transaction.atomic
    def register(
        cls,
        owner: Organization,
        name: str,
        spec: Mapping[str, Any],
        *,
        user: User | None,
        ip: str | None = None,
    ) -> Experiment:
        """Create the experiment and its first spec version; records the registration."""
        experiment = cls.objects.create(owner=owner, name=name, created_by=user)
        first = ExperimentSpec.create_version(experiment, 1, spec)
        experiment.current_spec = first
        experiment.save(update_fields=["current_spec"])
        AuditEvent.record(
            "experiment.registered",
            actor=user,
            organization=owner,
            target=experiment,
            detail={
                "experiment": experiment.full_name,
                "spec_version": 1,
                "spec_digest": first.digest,
            },
            ip=ip,
        )
        return experiment

    @transaction.atomic
    def revise_spec(
        self, spec: Mapping[str, Any], *, user: User | None = None, ip: str | None = None
    ) -> tuple[ExperimentSpec, bool]:
        """Apply a changed spec.

        A spec with no proof attached is edited in place; a frozen one (a proof names it)
        is kept as it is and the change becomes a new version. An identical spec changes
        nothing. A change is recorded as ``experiment.spec_edited`` or
        ``experiment.spec_versioned``.

        Returns:
            The current spec and whether anything changed.
        """
        spec_row, changed, versioned = self._revise(spec)
        if changed:
            AuditEvent.record(
                "experiment.spec_versioned" if versioned else "experiment.spec_edited",
                actor=user,
                organization=self.owner,
                target=self,
                detail={
                    "experiment": self.full_name,
                    "spec_version": spec_row.version,
                    "spec_digest": spec_row.digest,
                },
                ip=ip,
            )
        return spec_row, changed

    def _revise(self, spec: Mapping[str, Any]) -> tuple[ExperimentSpec, bool, bool]:
        """(current spec, changed, whether the change made a new version)."""
        assert self.current_spec_id is not None, "an experiment always has a spec"
        current = ExperimentSpec.objects.select_for_update().get(pk=self.current_spec_id)
        fields = ExperimentSpec.fields_from(spec)
        if all(getattr(current, key) == value for key, value in fields.items()):
            return current, False, False
        if current.is_frozen:
            latest = self.specs.aggregate(models.Max("version"))["version__max"] or 0
            new = ExperimentSpec.create_version(self, latest + 1, spec)
            self.current_spec = new
            self.save(update_fields=["current_spec"])
            return new, True, True
        for key, value in fields.items():
            setattr(current, key, value)
        current.digest = current.compute_digest()
        current.save()
        return current, True, False


class ExperimentSpec(models.Model):
    """One version of an experiment's declared spec; frozen once a proof names it."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="specs")
    version = models.PositiveIntegerField()
    framework = models.CharField(max_length=8, choices=Framework.choices)
    model_description = models.TextField(max_length=2000)
    optimizer = models.CharField(max_length=500)
    dataset_commitment = models.CharField(max_length=64, validators=[sha256_validator])
    max_flops = models.DecimalField(max_digits=40, decimal_places=0, null=True, blank=True)
    max_tokens = models.DecimalField(max_digits=30, decimal_places=0, null=True, blank=True)
    max_gpu_hours = models.DecimalField(max_digits=14, decimal_places=3, null=True, blank=True)
    allowed_regimes = models.JSONField(default=list)
    #: What ``max_tokens`` and the token claim count (zkdv's ``token_unit``): the
    #: batch's examples, or the token ids of a sequence model.
    token_unit = models.CharField(
        max_length=8,
        choices=[(unit, unit) for unit in TOKEN_UNITS],
        default=DEFAULT_TOKEN_UNIT,
    )
    #: The transcript digest of the run whose final model this run starts from (a
    #: fine-tune, continued pre-training or RL run of that model); blank: none declared.
    #: Certificates count the lineage's compute together against the thresholds that
    #: include fine-tuning (``docs/certificates.md``, "Lineage").
    parent_transcript = models.CharField(
        max_length=64, blank=True, default="", validators=[sha256_validator]
    )
    #: The platform kind the lab declares it trains on (``zkdv.environments``: cpu, gpu,
    #: tpu); blank: not declared. A transcript whose root names another is refused, and
    #: the run's replays go to workers of this kind (``docs/operators.md``).
    platform_kind = models.CharField(
        max_length=8,
        blank=True,
        default="",
        choices=[(kind, kind) for kind in PLATFORM_KINDS],
    )
    digest = models.CharField(max_length=64, db_index=True)
    created = models.DateTimeField(default=timezone.now)

    SPEC_FIELDS: ClassVar[tuple[str, ...]] = DECLARED_FIELDS

    class Meta:
        db_table = "attestations_experimentspec"
        constraints = [
            models.UniqueConstraint(fields=["experiment", "version"], name="spec_version_unique")
        ]
        ordering = ["-version"]

    def __str__(self) -> str:
        return f"{self.experiment_id} v{self.version}"

    @classmethod
    def fields_from(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        fields = {key: spec.get(key) for key in cls.SPEC_FIELDS}
        fields["allowed_regimes"] = sorted(set(fields["allowed_regimes"] or []))
        fields["token_unit"] = fields["token_unit"] or DEFAULT_TOKEN_UNIT
        fields["parent_transcript"] = str(fields["parent_transcript"] or "").lower()
        fields["platform_kind"] = str(fields["platform_kind"] or "")
        for key in ("max_flops", "max_tokens", "max_gpu_hours"):
            if fields[key] is not None:
                fields[key] = Decimal(str(fields[key]))
        return fields

    @classmethod
    def create_version(
        cls, experiment: Experiment, version: int, spec: Mapping[str, Any]
    ) -> ExperimentSpec:
        row = cls(experiment=experiment, version=version, **cls.fields_from(spec))
        row.digest = row.compute_digest()
        row.save()
        return row

    def canonical_document(self) -> dict[str, Any]:
        """The document whose canonical JSON (``dvbench.attest.canonical_json``) is hashed.

        One definition for the platform and the SDK (``dvbench.spec_document``), so an
        offline run binds the digest the platform computes. It binds the experiment id:
        the same limits declared for two experiments have two digests, and a transcript
        naming one cannot be filed under the other.
        """
        return dvbench.spec_document(self.experiment.full_name, self._spec_fields())

    def _spec_fields(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.SPEC_FIELDS}

    def compute_digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of :meth:`canonical_document`."""
        return dvbench.spec_digest(self.experiment.full_name, self._spec_fields())

    @property
    def is_frozen(self) -> bool:
        known = getattr(self, "_frozen", None)  # set from an annotated experiment row
        return bool(known) if known is not None else self.proofs.exists()

    def to_dict(self, *, frozen: bool | None = None) -> dict[str, Any]:
        """The API representation (``SpecSerializer``'s output, built directly)."""
        values = {field: getattr(self, field) for field in SPEC_FIELDS}
        return spec_document(values, self.is_frozen if frozen is None else frozen)
