"""DRF serializers: the API's boundary. They validate input and shape output; models act."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer, inline_serializer
from rest_framework import serializers

from attestations.accounts.models import (
    LAB_ROLE_CHOICES,
    ApiKey,
    Capability,
    Invitation,
    Membership,
    Organization,
    Role,
)
from attestations.audit.models import AuditEvent
from attestations.challenges.models import Challenge
from attestations.core.conf import api_datetime, dvbench_int
from attestations.core.validators import SHA256_HEX
from attestations.experiments.models import Experiment, ExperimentSpec, Framework, Regime
from attestations.http.fields import StrictCharField, StrictIntegerField
from attestations.http.permissions import require
from attestations.proofs.models import Job, Proof, ProofArtifact
from attestations.uploads.models import ArtifactKind, Upload, UploadPart
from attestations.uploads.s3 import MIN_PART_BYTES as S3_MIN_PART_BYTES
from attestations.uploads.services import max_part_bytes


def _big_integer_schema(max_digits: int) -> dict[str, Any]:
    return {
        "oneOf": [
            {"type": "integer", "minimum": 0, "maximum": 10**max_digits - 1},
            {"type": "string", "pattern": f"^[0-9]{{1,{max_digits}}}$"},
        ],
        "nullable": True,
        "description": "A whole number; as a JSON integer or a string of digits.",
    }


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
        text = str(data)
        if not re.fullmatch(r"[0-9]+", text):
            self.fail("invalid")
        if len(text.lstrip("0")) > self.max_digits:
            self.fail("max_digits", max_digits=self.max_digits)
        return Decimal(text)

    def to_representation(self, value: Any) -> int:
        return int(value)


@extend_schema_field(_big_integer_schema(40))
class FlopsField(BigIntegerField):
    pass


@extend_schema_field(_big_integer_schema(30))
class TokensField(BigIntegerField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=30, **kwargs)


GPU_HOURS_TEXT = re.compile(r"[0-9]{1,11}(?:\.[0-9]{1,3})?")


@extend_schema_field(
    {
        "oneOf": [
            {"type": "number", "minimum": 0, "maximum": 99999999999.999, "multipleOf": 0.001},
            {"type": "string", "pattern": r"^[0-9]{1,11}(\.[0-9]{1,3})?$"},
        ],
        "nullable": True,
        "description": "Non-negative, at most 3 decimal places; a JSON number or a string.",
    }
)
class GpuHoursField(serializers.Field):  # type: ignore[type-arg]
    """GPU-hours: up to 11 integer digits and 3 decimal places, as a number or a string."""

    default_error_messages = {
        "invalid": "Enter a non-negative number with at most 3 decimal places and 11 digits "
        'before the point (a JSON number or a string such as "1200.5").',
    }

    def to_internal_value(self, data: Any) -> Decimal:
        if isinstance(data, bool) or not isinstance(data, (int, float, str)):
            self.fail("invalid")
        if isinstance(data, str):
            if not GPU_HOURS_TEXT.fullmatch(data):
                self.fail("invalid")
            return Decimal(data)
        if not 0 <= data < 100_000_000_000:
            # Before any decimal arithmetic: 1e300 cannot even be quantized (a 500 once).
            self.fail("invalid")
        if isinstance(data, float):
            if not math.isfinite(data):
                self.fail("invalid")
            # A double is the nearest one to what the client wrote (1200.5), or the product
            # of some arithmetic (227700 * 0.001 == 227.70000000000002): take the decimal
            # of 3 places it stands for, if it is within a few units of the last place.
            value = Decimal(repr(data)).quantize(Decimal("0.001"))
            if abs(float(value) - data) > 4 * math.ulp(data):
                self.fail("invalid")
        else:
            value = Decimal(data)
        if value < 0 or value >= Decimal("100000000000"):
            self.fail("invalid")
        return value.quantize(Decimal("0.001"))

    def to_representation(self, value: Any) -> float:
        return float(value)


@extend_schema_field({"type": "string", "pattern": "^[0-9a-fA-F]{64}$"})
class Sha256Field(StrictCharField):
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
        fields = ["slug", "name", "kind", "created", "role"]

    @extend_schema_field(serializers.ChoiceField(choices=Role.choices, allow_null=True))
    def get_role(self, org: Organization) -> str | None:
        access = self.context.get("access")
        return access.roles.get(org.pk) if access is not None else None


#: Django's username rule (``UnicodeUsernameValidator``), for the schema and the fields.
USERNAME_PATTERN = r"^[\w.@+-]{1,150}$"


@extend_schema_field({"type": "string", "pattern": USERNAME_PATTERN, "maxLength": 150})
class UsernameField(StrictCharField):
    """A username, checked for its form only: whether anyone holds it is never revealed."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 150)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if not re.fullmatch(USERNAME_PATTERN, value):
            raise serializers.ValidationError(
                "Enter a username: letters, digits and @ . + - _ only.", code="invalid"
            )
        return value


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    """A member and their role. POST changes an existing member's role."""

    username = UsernameField(source="user.username")
    role = serializers.ChoiceField(
        choices=LAB_ROLE_CHOICES,
        help_text="A lab's roles. Regulators exist only in agencies, granted by the operator.",
    )

    class Meta:
        model = Membership
        fields = ["username", "role", "created"]
        read_only_fields = ["created"]

    def to_representation(self, instance: Membership) -> dict[str, Any]:
        # Agency members are regulators, a role this serializer does not accept as input.
        return {
            "username": instance.user.get_username(),
            "role": instance.role,
            "created": api_datetime(instance.created),
        }


@extend_schema_serializer(component_name="Member")
class MemberOutSerializer(serializers.Serializer[Membership]):
    """How a member is shown (an agency's members are regulators)."""

    username = serializers.CharField()
    role = serializers.ChoiceField(choices=Role.choices)
    created = serializers.DateTimeField()


class InvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation to join a lab: POST offers one (admins); the invitee accepts it."""

    username = UsernameField(help_text="Who is invited (the answer is the same for any name).")
    role = serializers.ChoiceField(choices=LAB_ROLE_CHOICES)
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    invited_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True, help_text="The admin who invited."
    )

    class Meta:
        model = Invitation
        fields = [
            "id",
            "organization",
            "username",
            "role",
            "status",
            "invited_by",
            "created",
            "expires",
            "responded",
        ]
        read_only_fields = ["id", "status", "created", "expires", "responded"]


class MeSerializer(serializers.Serializer[Any]):
    username = serializers.CharField()
    is_regulator = serializers.BooleanField()
    organizations = OrganizationSerializer(many=True)


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    prefix = serializers.CharField(read_only=True)
    is_active = serializers.BooleanField(read_only=True)
    name = StrictCharField(max_length=100, help_text="Where the key will live, e.g. 'ci'.")
    days = StrictIntegerField(write_only=True, required=False, min_value=1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The policy's maximum as configured now (a longer lifetime is a 400, not clamped).
        longest = dvbench_int("API_KEY_MAX_DAYS")
        self.fields["days"] = StrictIntegerField(
            write_only=True,
            required=False,
            min_value=1,
            max_value=longest,
            help_text=f"Lifetime in days, 1 to {longest} (DVBENCH_API_KEY_MAX_DAYS); "
            f"{dvbench_int('API_KEY_TTL_DAYS')} if absent.",
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
    model_description = StrictCharField(max_length=2000)
    optimizer = StrictCharField(max_length=500)
    dataset_commitment = Sha256Field(
        help_text="SHA-256 (hex) commitment to the training dataset manifest."
    )
    max_flops = FlopsField(required=False, allow_null=True, default=None)
    max_tokens = TokensField(required=False, allow_null=True, default=None)
    max_gpu_hours = GpuHoursField(required=False, allow_null=True, default=None)
    allowed_regimes = serializers.ListField(
        child=serializers.ChoiceField(choices=Regime.choices),
        allow_empty=True,
        default=list,
        max_length=len(Regime.choices),
    )
    token_unit = serializers.ChoiceField(
        choices=["examples", "tokens"],
        default="examples",
        help_text="What max_tokens and the token claim count: the batch's examples (the "
        "default), or the token ids of a sequence model (zkdv's token_unit).",
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
            "token_unit",
            "created",
        ]
        read_only_fields = ["version", "digest", "created"]


#: An organisation slug and an experiment name (``models.SLUG``, ``EXPERIMENT_NAME``).
SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$"
NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$"
FULL_NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?/[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$"


def _patterned(pattern: str, what: str) -> type[StrictCharField]:
    @extend_schema_field({"type": "string", "pattern": pattern})
    class Patterned(StrictCharField):
        def to_internal_value(self, data: Any) -> str:
            value = super().to_internal_value(data)
            if not re.fullmatch(pattern, value):
                raise serializers.ValidationError(f"Enter {what}.", code="invalid")
            return value

    Patterned.__name__ = f"Patterned{what.title().replace(' ', '')}"
    return Patterned


SlugField = _patterned(
    SLUG_PATTERN, "an organisation slug: 1-50 lowercase letters, digits or hyphens"
)
ExperimentNameField = _patterned(
    NAME_PATTERN, "an experiment name: 1-100 lowercase letters, digits, '.', '_' or '-'"
)
FullNameField = _patterned(FULL_NAME_PATTERN, "an experiment id of the form owner/name")


def visible_organization(request: Any, slug: str, capability: str) -> Organization:
    """The organisation ``slug`` where the caller holds ``capability``.

    One that does not exist and one the caller cannot see are the same 404
    (``does_not_exist``, field ``owner``): a body names nothing an id could not.

    Raises:
        NotFoundError: no such organisation, or out of sight.
        PermissionDenied: visible, but the role lacks ``capability`` (403).
    """
    from attestations.core.errors import NotFoundError
    from attestations.http.permissions import get_access

    organization = Organization.objects.filter(slug=slug).first()
    if organization is None or not get_access(request).can_see(organization.pk):
        raise NotFoundError(f"No organisation {slug!r}.", code="does_not_exist", field="owner")
    require(request, capability, organization.pk)
    return organization


class ExperimentSerializer(serializers.ModelSerializer[Experiment]):
    """An experiment with its current spec.

    To register, send ``owner`` and ``name``, or ``name`` as ``owner/name`` (and no
    ``owner``), and ``spec``.
    """

    id = serializers.CharField(source="full_name", read_only=True, help_text="owner/name")
    owner = serializers.CharField(source="owner.slug", required=False)
    name = serializers.CharField(max_length=151)
    spec = SpecSerializer(source="current_spec")
    spec_digest = serializers.CharField(source="current_spec.digest", read_only=True)
    created_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    proofs = serializers.SerializerMethodField()
    certificates = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = [
            "id",
            "owner",
            "name",
            "spec_digest",
            "spec",
            "created",
            "created_by",
            "proofs",
            "certificates",
        ]
        read_only_fields = ["created"]
        # Uniqueness of owner/name is checked in validate(), after scope, and with
        # "owner/name" accepted in `name`; DRF's generated validator would demand both.
        validators: list[Any] = []

    @extend_schema_field(
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "description": "How many proofs were filed, by status (statuses with none left out).",
        }
    )
    def get_proofs(self, experiment: Experiment) -> dict[str, int]:
        return experiment.proof_counts()

    @extend_schema_field(
        {
            "type": "object",
            "properties": {
                "PASSED": {"type": "integer", "minimum": 1},
                "FAILED": {"type": "integer", "minimum": 1},
            },
            "additionalProperties": False,
            "description": "How many of its proofs' certificates record PASSED and FAILED "
            "(results with none left out): the verdicts, where proofs counts transcript "
            "verification only.",
        }
    )
    def get_certificates(self, experiment: Experiment) -> dict[str, int]:
        return experiment.certificate_counts()

    def to_representation(self, instance: Experiment) -> dict[str, Any]:
        frozen = getattr(instance, "spec_frozen", None)
        if frozen is not None and instance.current_spec is not None:
            instance.current_spec._frozen = frozen  # type: ignore[attr-defined]
        return super().to_representation(instance)


class ExperimentByOwnerSerializer(serializers.Serializer[Any]):
    """Register an experiment: the owner's slug and the experiment's name."""

    owner = SlugField(help_text="The organisation's slug.")
    name = ExperimentNameField()
    spec = SpecSerializer()


class ExperimentByIdSerializer(serializers.Serializer[Any]):
    """Register an experiment by its id, ``owner/name`` (no separate ``owner``)."""

    name = FullNameField(help_text="owner/name")
    spec = SpecSerializer()


class ExperimentRegistration(serializers.Serializer[Any]):
    """A registration in either form; checks scope and uniqueness after the shape."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if isinstance(data, dict) and "owner" not in data and "/" in str(data.get("name", "")):
            form: serializers.Serializer[Any] = ExperimentByIdSerializer(data=data)
        else:
            form = ExperimentByOwnerSerializer(data=data)
        form.is_valid(raise_exception=True)
        attrs = dict(form.validated_data)
        if "owner" not in attrs:
            attrs["owner"], _, attrs["name"] = attrs["name"].partition("/")
        request = self.context["request"]
        # Scope before existence: an outsider learns nothing about the owner's names, and
        # an organisation out of sight is the same 404 as one that does not exist.
        attrs["owner"] = visible_organization(request, attrs["owner"], Capability.WRITE)
        if Experiment.objects.filter(owner=attrs["owner"], name=attrs["name"]).exists():
            from attestations.core.errors import ConflictError

            raise ConflictError(
                f"{attrs['owner'].slug}/{attrs['name']} is already registered.",
                code="exists",
                field="name",
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
                "target": serializers.FloatField(
                    help_text="The probability this filing catches a run with the forged "
                    "fraction (the policy's target, tightened for later filings)"
                ),
                "forged_fraction": serializers.FloatField(),
                "filing": serializers.IntegerField(
                    allow_null=True,
                    help_text="This proof's place among the experiment's challenged proofs",
                ),
                "run_digest": serializers.CharField(
                    allow_null=True,
                    help_text="SHA-256 of the committed run the seed and steps derive from",
                ),
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
            "filing": proof.challenge_filing,
            "run_digest": proof.challenge_run_digest or None,
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


class UploadPartURLRequestSerializer(serializers.Serializer[Any]):
    """A direct upload's part, declared before it is sent to object storage."""

    size = StrictIntegerField(min_value=1, help_text="The part's size in bytes.")
    sha256 = Sha256Field(help_text="SHA-256 (hex) of the part's bytes.")


class UploadSerializer(serializers.ModelSerializer[Upload]):
    experiment = FullNameField(
        source="experiment.full_name", help_text="The experiment, as owner/name."
    )
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    size = StrictIntegerField(min_value=1, help_text="Total size of the blob in bytes.")
    sha256 = Sha256Field(help_text="SHA-256 (hex) of the whole blob.")
    name = StrictCharField(
        max_length=255,
        required=False,
        allow_blank=True,
        default="",
        help_text="The file's path in the proof directory (informational).",
    )
    parts = serializers.SerializerMethodField()
    received_bytes = serializers.SerializerMethodField()
    direct = serializers.BooleanField(
        read_only=True,
        help_text="Parts go straight to object storage: ask for each part's URL "
        "(POST uploads/{id}/parts/{n}/url/) and PUT it there.",
    )
    min_part_bytes = serializers.SerializerMethodField()
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
            "direct",
            "min_part_bytes",
            "max_part_bytes",
            "blob_sha256",
            "proof",
            "created",
            "expires",
            "completed",
        ]
        read_only_fields = ["id", "status", "reason", "created", "expires", "completed"]

    @extend_schema_field(
        serializers.IntegerField(
            allow_null=True,
            help_text="The proof a completed transcript upload filed, or the proof it repeats "
            "(a transcript already filed for the experiment is not filed twice)",
        )
    )
    def get_proof(self, upload: Upload) -> int | None:
        return upload.filed_proof_id

    def get_max_part_bytes(self, upload: Upload) -> int:
        return max_part_bytes()

    @extend_schema_field(
        serializers.IntegerField(
            help_text="The least size of any part but the last (object storage's, 5 MiB, "
            "for a direct upload; 1 otherwise)"
        )
    )
    def get_min_part_bytes(self, upload: Upload) -> int:
        return S3_MIN_PART_BYTES if upload.direct else 1

    def _parts(self, upload: Upload) -> list[dict[str, Any]]:
        held = self.context.get("direct_parts")
        if held is not None:
            return list(held)
        return [dict(UploadPartSerializer(part).data) for part in upload.parts.all()]

    @extend_schema_field(
        UploadPartSerializer(
            many=True,
            help_text="Parts received; for an open direct upload, the declared parts object "
            "storage holds",
        )
    )
    def get_parts(self, upload: Upload) -> list[dict[str, Any]]:
        return self._parts(upload)

    @extend_schema_field(serializers.IntegerField())
    def get_received_bytes(self, upload: Upload) -> int:
        return sum(int(part["size"]) for part in self._parts(upload))


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

    name = StrictCharField(max_length=255)
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    sha256 = Sha256Field()
    size = StrictIntegerField(min_value=1)


class ArtifactListSerializer(serializers.Serializer[Any]):
    files = serializers.ListField(
        child=ArtifactClaimSerializer(), allow_empty=True, max_length=100_000
    )


class AuditEventSerializer(serializers.ModelSerializer[AuditEvent]):
    actor = serializers.CharField(source="actor_name", read_only=True)
    # Null for an event of no organisation (an API key created or revoked).
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True
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
