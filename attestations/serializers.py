"""DRF serializers: the API's boundary. They validate input and shape output; models act."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field, inline_serializer
from rest_framework import serializers

from attestations.models import (
    SHA256_HEX,
    ApiKey,
    ArtifactKind,
    AuditEvent,
    Capability,
    Challenge,
    Experiment,
    ExperimentSpec,
    Framework,
    Job,
    Membership,
    Organization,
    Proof,
    ProofArtifact,
    Regime,
    Role,
    Upload,
    UploadPart,
    api_datetime,
    experiment_name_validator,
)
from attestations.permissions import require
from attestations.uploads import max_part_bytes


@extend_schema_field(OpenApiTypes.INT)
class BigIntegerField(serializers.Field):  # type: ignore[type-arg]
    """A non-negative integer of any size (FLOPs exceed 64 bits), as a JSON integer.

    Accepts a JSON integer or a string of digits; an integral float such as ``1e25`` is
    refused because it has already lost precision by the time it reaches us.
    """

    default_error_messages = {
        "invalid": "Enter a non-negative whole number (a JSON integer or a string of digits).",
        "max_digits": "Enter at most {max_digits} digits.",
    }

    def __init__(self, *, max_digits: int = 40, **kwargs: Any) -> None:
        self.max_digits = max_digits
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Decimal:
        if isinstance(data, bool) or not isinstance(data, (int, str)):
            self.fail("invalid")
        text = str(data).strip()
        if not re.fullmatch(r"[0-9]+", text):
            self.fail("invalid")
        if len(text.lstrip("0")) > self.max_digits:
            self.fail("max_digits", max_digits=self.max_digits)
        return Decimal(text)

    def to_representation(self, value: Any) -> int:
        return int(value)


class Sha256Field(serializers.CharField):
    """A SHA-256 hex digest; upper-case input is normalised to lower case."""

    def to_internal_value(self, data: Any) -> str:
        value = str(super().to_internal_value(data)).lower()
        if not SHA256_HEX.match(value):
            raise serializers.ValidationError(
                f"Enter a SHA-256 hex digest of 64 characters, got {len(value)} characters."
                if len(value) != 64
                else "Enter a SHA-256 hex digest (characters 0-9 and a-f only).",
                code="invalid_digest",
            )
        return value


# --- Accounts ---------------------------------------------------------------------------


class OrganizationSerializer(serializers.ModelSerializer[Organization]):
    role = serializers.SerializerMethodField()

    class Meta:
        model = Organization
        fields = ["slug", "name", "created", "role"]

    def get_role(self, org: Organization) -> str | None:
        access = self.context.get("access")
        return access.roles.get(org.pk) if access is not None else None


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    username = serializers.CharField(source="user.username")
    role = serializers.ChoiceField(choices=Role.choices)

    class Meta:
        model = Membership
        fields = ["username", "role", "created"]
        read_only_fields = ["created"]

    def validate_username(self, value: str) -> str:
        if not get_user_model().objects.filter(username=value, is_active=True).exists():
            raise serializers.ValidationError(
                f"No active user named {value!r}.", code="unknown_user"
            )
        return value


class MeSerializer(serializers.Serializer[Any]):
    username = serializers.CharField()
    is_regulator = serializers.BooleanField()
    organizations = OrganizationSerializer(many=True)


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    prefix = serializers.CharField(read_only=True)
    is_active = serializers.BooleanField(read_only=True)
    days = serializers.IntegerField(
        write_only=True, required=False, min_value=1, max_value=365, help_text="Lifetime in days."
    )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "created",
            "expires",
            "revoked",
            "last_used",
            "is_active",
            "days",
        ]
        read_only_fields = ["id", "created", "expires", "revoked", "last_used"]


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself, shown only once.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


# --- Experiments ------------------------------------------------------------------------


class SpecSerializer(serializers.ModelSerializer[ExperimentSpec]):
    """A declared spec. Limits left null are undeclared (and so unbounded)."""

    framework = serializers.ChoiceField(choices=Framework.choices)
    model_description = serializers.CharField(max_length=2000)
    optimizer = serializers.CharField(max_length=500)
    dataset_commitment = Sha256Field(
        help_text="SHA-256 (hex) commitment to the training dataset manifest."
    )
    max_flops = BigIntegerField(required=False, allow_null=True, default=None)
    max_tokens = BigIntegerField(max_digits=30, required=False, allow_null=True, default=None)
    max_gpu_hours = serializers.DecimalField(
        max_digits=14,
        decimal_places=3,
        min_value=Decimal(0),
        required=False,
        allow_null=True,
        default=None,
        coerce_to_string=False,
    )
    allowed_regimes = serializers.ListField(
        child=serializers.ChoiceField(choices=Regime.choices), allow_empty=True, default=list
    )
    frozen = serializers.BooleanField(source="is_frozen", read_only=True)

    class Meta:
        model = ExperimentSpec
        fields = [
            "version",
            "digest",
            "frozen",
            "framework",
            "model_description",
            "optimizer",
            "dataset_commitment",
            "max_flops",
            "max_tokens",
            "max_gpu_hours",
            "allowed_regimes",
            "created",
        ]
        read_only_fields = ["version", "digest", "created"]


class ExperimentSerializer(serializers.ModelSerializer[Experiment]):
    """An experiment with its current spec.

    To register, send ``owner`` and ``name``, or ``name`` as ``owner/name``, and ``spec``.
    """

    id = serializers.CharField(source="full_name", read_only=True, help_text="owner/name")
    owner = serializers.SlugRelatedField(
        slug_field="slug", queryset=Organization.objects.all(), required=False
    )
    name = serializers.CharField(max_length=151)
    spec = SpecSerializer(source="current_spec")
    spec_digest = serializers.CharField(source="current_spec.digest", read_only=True)
    created_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    proofs = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = ["id", "owner", "name", "spec_digest", "spec", "created", "created_by", "proofs"]
        read_only_fields = ["created"]
        # Uniqueness of owner/name is checked in validate(), after scope, and with
        # "owner/name" accepted in `name`; DRF's generated validator would demand both.
        validators: list[Any] = []

    def get_proofs(self, experiment: Experiment) -> dict[str, int]:
        return experiment.proof_counts()

    def to_representation(self, instance: Experiment) -> dict[str, Any]:
        frozen = getattr(instance, "spec_frozen", None)
        if frozen is not None and instance.current_spec is not None:
            instance.current_spec._frozen = frozen  # type: ignore[attr-defined]
        return super().to_representation(instance)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        name = attrs["name"]
        if "/" in name:
            owner_slug, _, name = name.partition("/")
            if "owner" in attrs and attrs["owner"].slug != owner_slug:
                raise serializers.ValidationError(
                    {"name": [f"names owner {owner_slug!r} but owner is {attrs['owner'].slug!r}."]}
                )
            owner = Organization.objects.filter(slug=owner_slug).first()
            if owner is None:
                raise serializers.ValidationError(
                    {"owner": [f"No organisation {owner_slug!r}."]}, code="does_not_exist"
                )
            attrs["owner"] = owner
        if "owner" not in attrs:
            raise serializers.ValidationError(
                {"owner": ["Give the owner, or a name of the form owner/name."]}, code="required"
            )
        try:
            experiment_name_validator(name)
        except Exception as error:  # noqa: BLE001 - Django's ValidationError, re-raised as DRF's
            raise serializers.ValidationError(
                {"name": [str(getattr(error, "message", error))]}
            ) from None
        attrs["name"] = name
        request = self.context.get("request")
        if request is not None:
            # Scope before existence: an outsider learns nothing about the owner's names.
            require(request, Capability.WRITE, attrs["owner"].pk)
        if Experiment.objects.filter(owner=attrs["owner"], name=name).exists():
            raise serializers.ValidationError(
                {"name": [f"{attrs['owner'].slug}/{name} is already registered."]}, code="exists"
            )
        return attrs


# --- Proofs, jobs, uploads --------------------------------------------------------------


class JobSerializer(serializers.ModelSerializer[Job]):
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "kind",
            "organization",
            "proof",
            "status",
            "progress",
            "steps_done",
            "steps_total",
            "reason",
            "created",
            "started",
            "finished",
        ]


class ProofSerializer(serializers.ModelSerializer[Proof]):
    experiment = serializers.CharField(source="experiment.full_name", read_only=True)
    spec_version = serializers.IntegerField(source="spec.version", read_only=True)
    spec_digest = serializers.CharField(source="spec.digest", read_only=True)
    transcript_sha256 = serializers.CharField(source="transcript.sha256", read_only=True)
    record = serializers.IntegerField(source="record_index", read_only=True, allow_null=True)
    job = serializers.SerializerMethodField()
    challenge_plan = serializers.SerializerMethodField()

    class Meta:
        model = Proof
        fields = [
            "id",
            "experiment",
            "spec_version",
            "spec_digest",
            "status",
            "reason",
            "message",
            "record",
            "field",
            "steps",
            "checks",
            "prover",
            "transcript_sha256",
            "transcript_digest",
            "created",
            "verified",
            "job",
            "challenge_plan",
        ]

    @extend_schema_field(
        inline_serializer(
            "ChallengePlan",
            {
                "seed_commitment": serializers.CharField(),
                "seed": serializers.CharField(allow_null=True),
                "target": serializers.FloatField(),
                "forged_fraction": serializers.FloatField(),
                "drawn": serializers.DateTimeField(),
                "deadline": serializers.DateTimeField(),
            },
            allow_null=True,
        )
    )
    def get_challenge_plan(self, proof: Proof) -> dict[str, Any] | None:
        """The platform's challenges: the seed's SHA-256 now, the seed once final."""
        if proof.challenges_drawn is None:
            return None
        return {
            "seed_commitment": proof.challenge_seed_commitment,
            "seed": proof.revealed_seed,
            "target": proof.challenge_target,
            "forged_fraction": proof.challenge_forged_fraction,
            "drawn": api_datetime(proof.challenges_drawn),
            "deadline": api_datetime(proof.challenge_deadline),
        }

    @extend_schema_field(JobSerializer(allow_null=True))
    def get_job(self, proof: Proof) -> dict[str, Any] | None:
        # jobs.all() is prefetched by the views: pick the latest without another query.
        jobs = sorted(proof.jobs.all(), key=lambda job: job.created)
        return JobSerializer(jobs[-1]).data if jobs else None


class UploadPartSerializer(serializers.ModelSerializer[UploadPart]):
    class Meta:
        model = UploadPart
        fields = ["number", "size", "sha256"]


class UploadSerializer(serializers.ModelSerializer[Upload]):
    experiment = serializers.CharField(
        source="experiment.full_name", help_text="The experiment, as owner/name."
    )
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    size = serializers.IntegerField(min_value=1, help_text="Total size of the blob in bytes.")
    sha256 = Sha256Field(help_text="SHA-256 (hex) of the whole blob.")
    name = serializers.CharField(
        max_length=255,
        required=False,
        allow_blank=True,
        default="",
        help_text="The file's path in the proof directory (informational).",
    )
    parts = UploadPartSerializer(many=True, read_only=True)
    received_bytes = serializers.IntegerField(read_only=True)
    blob_sha256 = serializers.CharField(source="blob.sha256", read_only=True, allow_null=True)
    proof = serializers.SerializerMethodField()
    max_part_bytes = serializers.SerializerMethodField()

    class Meta:
        model = Upload
        fields = [
            "id",
            "experiment",
            "kind",
            "name",
            "size",
            "sha256",
            "status",
            "reason",
            "received_bytes",
            "parts",
            "max_part_bytes",
            "blob_sha256",
            "proof",
            "created",
            "expires",
            "completed",
        ]
        read_only_fields = ["id", "status", "reason", "created", "expires", "completed"]

    def get_proof(self, upload: Upload) -> int | None:
        try:
            return upload.proof.pk
        except Proof.DoesNotExist:
            return None

    def get_max_part_bytes(self, upload: Upload) -> int:
        return max_part_bytes()

    def validate_experiment(self, value: str) -> Experiment:
        experiment = (
            Experiment.objects.by_full_name(value).select_related("owner", "current_spec").first()
        )
        if experiment is None:
            raise serializers.ValidationError(f"No experiment {value!r}.", code="does_not_exist")
        return experiment


class ChallengeSerializer(serializers.ModelSerializer[Challenge]):
    """One challenge: what is replayed, what it needs, how far it got, its verdict."""

    class Meta:
        model = Challenge
        fields = [
            "id",
            "proof",
            "step",
            "through",
            "origin",
            "status",
            "needed_files",
            "steps_total",
            "steps_replayed",
            "attempts",
            "reason",
            "message",
            "evidence",
            "created",
            "answered",
            "finished",
        ]
        read_only_fields = fields


class ProofArtifactSerializer(serializers.ModelSerializer[ProofArtifact]):
    class Meta:
        model = ProofArtifact
        fields = ["name", "kind", "sha256", "size", "created"]
        read_only_fields = fields


class ArtifactClaimSerializer(serializers.Serializer[Any]):
    """One file of ``POST proofs/{id}/artifacts/``: an uploaded blob and its name."""

    name = serializers.CharField(max_length=255, trim_whitespace=False)
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    sha256 = Sha256Field()
    size = serializers.IntegerField(min_value=1)


class ArtifactListSerializer(serializers.Serializer[Any]):
    files = serializers.ListField(
        child=ArtifactClaimSerializer(), allow_empty=True, max_length=100_000
    )


class AuditEventSerializer(serializers.ModelSerializer[AuditEvent]):
    actor = serializers.CharField(source="actor_name", read_only=True)
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created",
            "actor",
            "organization",
            "action",
            "target_type",
            "target_id",
            "detail",
            "ip",
        ]
